"""`swarm admin ...`: the leader's settings, join tokens, pools, users' passwords and fellows from the command line,
through the leader's routes (swarm.leader.admin_api); `swarm admin migrate-db` works on the leader's files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from swarm import cli_quotas
from swarm.config import Settings, default_data_dir
from swarm.errors import SwarmError


def _duration(text: str) -> float:
    """Seconds from "3600", "90s", "30m", "24h" or "7d"."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    scale = units.get(text[-1:], None)
    try:
        value = float(text[:-1] if scale else text) * (scale or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration; write e.g. 3600, 30m, 24h or 7d") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("a duration must be positive")
    return value


def add_parser(sub, leader_options) -> None:
    """The `swarm admin` command and its subcommands, under the top parser's ``sub``."""
    p = sub.add_parser("admin", help="leader settings (admins)")
    asub = p.add_subparsers(dest="admin_command", required=True)
    ad = asub.add_parser("direct-links", help="let stages that cannot reach each other's port punch an encrypted "
                                             "tunnel through their NATs (off by default)")
    ad.add_argument("state", nargs="?", choices=["on", "off"], help="omit to show the current state")
    leader_options(ad)
    aj = asub.add_parser("join-token", help="mint a join token (by default it lets one fellow join, within 24 h)")
    aj.add_argument("--uses", type=int, default=1, help="how many fellows may join with it (default 1)")
    aj.add_argument("--ttl", type=_duration, default=24 * 3600.0,
                    help="how long it is valid: 3600, 30m, 24h or 7d (default 24h)")
    aj.add_argument("--pool", default="default", help="the pool the fellow joins and serves (default: default)")
    leader_options(aj)
    for command, help_text, args in (
            ("pools", "list the pools, their members, fellows and models", ()),
            ("pool-create", "create a pool (fellows join it with a join token of --pool NAME)", ("pool",)),
            ("pool-delete", "delete an empty pool (no fellows, no models)", ("pool",)),
            ("pool-members", "list a pool's members", ("pool",)),
            ("pool-member-add", "make a user a member of a pool: they see its models", ("pool", "user")),
            ("pool-member-remove", "take a user out of a pool", ("pool", "user"))):
        pp = asub.add_parser(command, help=help_text)
        for arg in args:
            pp.add_argument(arg, help="its name" if arg == "pool" else "their name or id")
        leader_options(pp)
    al = asub.add_parser("join-tokens", help="list the join tokens (their prefixes, expiry and uses left)")
    leader_options(al)
    ar = asub.add_parser("revoke-join-token", help="revoke a join token: nobody joins with it any more")
    ar.add_argument("token_id", type=int, help="its id, from `swarm admin join-tokens`")
    leader_options(ar)
    ap = asub.add_parser("password", help="set a user's password (asked twice; read from stdin when piped)")
    ap.add_argument("--user", help="whose (default: the owner of the API token)")
    leader_options(ap)
    af = asub.add_parser("fellows", help="list the enrolled fellows")
    leader_options(af)
    ax = asub.add_parser("remove-fellow", help="remove a fellow: its link ends, its key and credential are refused")
    ax.add_argument("fellow", help="its id or name, from `swarm admin fellows`")
    leader_options(ax)
    cli_quotas.add_parsers(asub, leader_options)
    am = asub.add_parser("migrate-db", help="copy a SQLite leader's store (stop the leader first) into an empty "
                                            "PostgreSQL database; then run it with SWARM_DATABASE_URL")
    am.add_argument("--to", required=True, metavar="URL", help="postgresql://user:password@host/db, empty")
    am.add_argument("--data-dir", type=Path, help="the leader's data dir (the folder holding leader.db)")


def migrate_db(args, settings: Settings) -> None:
    from swarm.store.copy_db import copy_to_postgres
    from swarm.store.dialect import is_postgres_url, redact

    if not is_postgres_url(args.to):
        raise SwarmError(f"--to {args.to!r} is not a postgresql:// URL; write postgresql://user:password@host/db.")
    data_dir = args.data_dir or settings.data_dir or default_data_dir("leader")
    counts = copy_to_postgres(data_dir / "leader.db", args.to)
    print("Copied " + ", ".join(f"{n} {table}" for table, n in counts.items()) + f" to {redact(args.to)}.")
    print(f"Start the leader with SWARM_DATABASE_URL={redact(args.to)} (with its password) to use it; "
          f"{data_dir / 'leader.db'} stays as it was.")


def run(client, args) -> None:
    """`swarm admin COMMAND` through the leader's routes (all but migrate-db)."""
    import time

    command = args.admin_command
    if command.startswith("quota") or command == "usage":
        cli_quotas.run(client, args)
    elif command == "direct-links":
        if args.state is None:
            enabled = client.get("/api/v1/settings/direct-links")["enabled"]
        else:
            enabled = client.put("/api/v1/settings/direct-links", {"enabled": args.state == "on"})["enabled"]
        print(f"Direct links: {'on' if enabled else 'off'}")
    elif command == "join-token":
        made = client.post("/api/v1/join-tokens", {"uses": args.uses, "ttl_s": args.ttl, "pool": args.pool})
        hours = made["ttl_s"] / 3600
        print(made["token"])
        print(f"(lets {made['uses']} fellow{'s' if made['uses'] != 1 else ''} join within {hours:g} h, into pool "
              f"{made['pool']}: swarm join URL --token <it>)", file=sys.stderr)
    elif command.startswith("pool"):
        _pools(client, args)
    elif command == "join-tokens":
        now = time.time()
        for t in client.get("/api/v1/join-tokens")["join_tokens"]:
            if t["revoked"]:
                state = "revoked"
            elif t["expires_at"] is not None and t["expires_at"] <= now:
                state = "expired"
            elif t.get("uses_left") == 0:
                state = "used up"
            else:
                left = "" if t.get("uses_left") is None else f", {t['uses_left']} of {t['uses']} uses left"
                state = f"valid {max(0.0, (t['expires_at'] or now) - now) / 3600:.1f} h more{left}"
            print(f"{t['id']:5} {t['prefix']}…  {state}")
    elif command == "revoke-join-token":
        client.delete(f"/api/v1/join-tokens/{args.token_id}")
        print(f"Revoked join token {args.token_id}")
    elif command == "password":
        users = client.get("/api/v1/users")["users"]
        name = args.user or client.get("/api/v1/me")["user"]["name"]
        user = next((u for u in users if u["name"].casefold() == name.casefold()), None)
        if user is None:
            raise SwarmError(f"the leader has no user {name!r}.")
        if sys.stdin.isatty():
            import getpass

            password = getpass.getpass(f"New password for {user['name']}: ")
            if getpass.getpass("Again: ") != password:
                raise SwarmError("the two passwords differ; nothing was changed.")
        else:
            password = sys.stdin.readline().rstrip("\n")
        client.put(f"/api/v1/users/{user['id']}/password", {"password": password})
        print(f"Changed the password of {user['name']}; their browsers are signed out")
    elif command == "fellows":
        for f in client.get("/api/v1/fellows")["fellows"]:
            version = f"{f['version']} (protocol {f['protocol']}){' outdated' if f.get('outdated') else ''}" \
                if f.get("version") else "-"
            print(f"{f['id']:5} {f['name']:24} {f['state']:8} {version:28} {', '.join(f.get('stages') or []) or '-'}")
    elif command == "remove-fellow":
        fellows = client.get("/api/v1/fellows")["fellows"]
        match = [f for f in fellows if str(f["id"]) == args.fellow or f["name"] == args.fellow]
        if not match:
            raise SwarmError(f"the leader has no fellow {args.fellow!r}; `swarm admin fellows` lists them.")
        client.delete(f"/api/v1/fellows/{match[0]['id']}")
        print(f"Removed fellow {match[0]['name']} ({match[0]['id']}); its key is refused from now on")


def _pools(client, args) -> None:
    """`swarm admin pools`, `pool-create`, `pool-delete`, `pool-members`, `pool-member-add`, `pool-member-remove`."""
    from urllib.parse import quote

    command = args.admin_command
    if command == "pools":
        for p in client.get("/api/v1/pools")["pools"]:
            members = ", ".join(m["name"] for m in p.get("members", [])) or "-"
            fellows = ", ".join(f["name"] for f in p.get("fellows", [])) or "-"
            print(f"{p['name']:20} members: {members}; fellows: {fellows}; models: {', '.join(p['models']) or '-'}")
        return
    pool = quote(args.pool, safe="")
    if command == "pool-create":
        made = client.post("/api/v1/pools", {"name": args.pool})["pool"]
        print(f"Created pool {made['name']} ({made['path']}); add fellows with "
              f"`swarm admin join-token --pool {made['name']}`, users with `swarm admin pool-member-add`")
    elif command == "pool-delete":
        client.delete(f"/api/v1/pools/{pool}")
        print(f"Deleted pool {args.pool}")
    elif command == "pool-member-add":
        members = client.post(f"/api/v1/pools/{pool}/members", {"user": args.user})["members"]
        print(f"Pool {args.pool}: {', '.join(m['name'] for m in members)}")
    elif command == "pool-member-remove":
        members = client.delete(f"/api/v1/pools/{pool}/members/{quote(args.user, safe='')}")["members"]
        print(f"Pool {args.pool}: {', '.join(m['name'] for m in members) or 'no members'}")
    else:
        members = client.get(f"/api/v1/pools/{pool}/members")["members"]
        print(f"Pool {args.pool}: {', '.join(m['name'] for m in members) or 'no members'}")
