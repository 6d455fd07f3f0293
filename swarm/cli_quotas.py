"""`swarm admin quotas`, `quota-set`, `quota-remove` and `usage`: quotas and usage from the command line, through the
leader's routes (swarm.leader.api.usage_api)."""

from __future__ import annotations

import time
import urllib.parse

from swarm.leader.serving.quotas import LIMITS

SCOPES = ("pool", "user", "token")


def add_parsers(asub, leader_options) -> None:
    aq = asub.add_parser("quotas", help="list the quotas: per pool (its users' default), per user, per API token")
    leader_options(aq)
    qs = asub.add_parser("quota-set", help="set the limits of a pool's users, a user or an API token (limits left "
                                           "out: none; replaces what was set)")
    qs.add_argument("scope", choices=SCOPES)
    qs.add_argument("ref", help="the pool's or user's name (or id), the API token's id")
    for name in LIMITS:
        qs.add_argument(f"--{name.replace('_', '-')}", type=int, metavar="N", dest=name)
    leader_options(qs)
    qr = asub.add_parser("quota-remove", help="remove the limits of a pool's users, a user or an API token")
    qr.add_argument("scope", choices=SCOPES)
    qr.add_argument("ref")
    leader_options(qr)
    au = asub.add_parser("usage", help="requests and tokens per hour or day, per user, token and model (an admin "
                                       "sees everyone's, a user their own)")
    au.add_argument("--range", default="24h", help="how far back: 24h, 7d... (default 24h)")
    au.add_argument("--step", choices=["hour", "day"], help="default: hour up to 2 days, else day")
    au.add_argument("--by", default="user,model", help="any of user, token, model, comma separated")
    au.add_argument("--user", help="one user's (admins)")
    au.add_argument("--csv", action="store_true", help="print CSV")
    leader_options(au)


def run(client, args) -> None:
    command = args.admin_command
    if command == "quotas":
        rows = client.get("/api/v1/quotas")["quotas"]
        if not rows:
            print("No quotas: every user may use the pools as much as the queue allows.")
        for q in rows:
            shown = ", ".join(f"{k} {v}" for k, v in sorted(q["limits"].items()) if v is not None) or "no limits"
            print(f"{q['scope']:<6} {q['name'] or q['id']}: {shown}")
    elif command == "quota-set":
        limits = {name: getattr(args, name) for name in LIMITS if getattr(args, name) is not None}
        answer = client.put(f"/api/v1/quotas/{args.scope}/{urllib.parse.quote(args.ref, safe='')}", limits)
        print(f"{args.scope} {args.ref}: " + (", ".join(f"{k} {v}" for k, v in answer["limits"].items())
                                               or "no limits (frees it of the pool's default)"))
    elif command == "quota-remove":
        client.delete(f"/api/v1/quotas/{args.scope}/{urllib.parse.quote(args.ref, safe='')}")
        print(f"{args.scope} {args.ref}: its quota is removed")
    elif command == "usage":
        query = {"range": args.range, "by": args.by}
        if args.step:
            query["step"] = args.step
        if args.user:
            query["user"] = args.user
        if args.csv:
            print(client.get_text("/api/v1/usage?" + urllib.parse.urlencode({**query, "format": "csv"})), end="")
            return
        data = client.get("/api/v1/usage?" + urllib.parse.urlencode(query))
        fmt = "%Y-%m-%d %H:%M" if data["step"] == "hour" else "%Y-%m-%d"
        for row in data["rows"]:
            who = " ".join(str(row.get(g) if row.get(g) is not None else "-") for g in data["by"])
            print(f"{time.strftime(fmt, time.gmtime(row['period_start']))} UTC  {who}: {row['requests']} requests "
                  f"({row['failed']} failed), {row['prompt_tokens']} prompt + {row['completion_tokens']} "
                  "completion tokens")
        if not data["rows"]:
            print("No requests in that range.")
