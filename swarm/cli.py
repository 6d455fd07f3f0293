"""The `swarm` command line. Errors from swarm are printed as one clear message (no stack trace) and exit 1."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from swarm import cli_admin
from swarm.config import Settings, default_data_dir
from swarm.errors import SwarmError
from swarm.kv_kinds import KV_KINDS
from swarm.quantization import KINDS

# A fellow's OpenMP threads spin only briefly between two operations before they sleep: long enough to keep a pass
# fast, short enough that another fellow on the same machine gets the cores between passes. Measured on the demo
# (2 stages, 2 cores): the default spin gave one chat 16 tok/s but four chats only 17 in all; passive waiting 10 and
# 29; GOMP_SPINCOUNT=20000 (with busy stages on their share of the cores) 20 and 43 (bench/HISTORY.md).
FELLOW_THREAD_ENV = {"GOMP_SPINCOUNT": "20000"}


def _leader_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--leader", help="the leader's URL (or SWARM_LEADER)")
    p.add_argument("--token", help="an API token (or SWARM_TOKEN)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm", description="Run a large language model split over several PCs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("leader", help="run the leader server")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--data-dir", type=Path)
    p.add_argument("--tls-cert", type=Path, help="serve HTTPS with this certificate (PEM); join tokens then pin it")
    p.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")

    p = sub.add_parser("join", help="run a fellow that joins a leader")
    p.add_argument("url", help="the leader's URL, e.g. http://leader:8000")
    p.add_argument("--token", help="the join token the leader printed (needed the first time)")
    p.add_argument("--name", help="this fellow's name (default: the host name)")
    p.add_argument("--standby", action="store_true",
                   help="stand by to take over the stage of a fellow that drops out; plain loads leave it alone")
    p.add_argument("--data-dir", type=Path)
    p.add_argument("--check", action="store_true",
                   help="join once, print what this PC can hold of the leader's models, and exit")

    p = sub.add_parser("leave", help="hand this fellow's stages to other fellows, then stop it (no pause in replies)")
    p.add_argument("--data-dir", type=Path, help="the fellow's data dir (as given to swarm join)")
    p.add_argument("--force", action="store_true",
                   help="leave even when no fellow can take a stage: that stage then fails over (replies pause)")

    p = sub.add_parser("update", help="install the leader's version of swarm on this fellow and restart it")
    p.add_argument("--data-dir", type=Path, help="the fellow's data dir (as given to swarm join)")
    p.add_argument("--force", action="store_true", help="install it even when the versions already match")

    p = sub.add_parser("model", help="manage the model catalogue")
    msub = p.add_subparsers(dest="model_command", required=True)
    mi = msub.add_parser("import", help="import a transformers folder, a .gguf file or smollm2-135m-instruct")
    mi.add_argument("source")
    mi.add_argument("--name")
    mi.add_argument("--pool", default="default",
                    help="the pool to import it into (default: default); there its id is NAME@POOL")
    mi.add_argument("--data-dir", type=Path, help="the leader's data dir")
    mi.add_argument("--replace", action="store_true",
                    help="replace a model of the same name (the old one stays if the import fails)")
    mi.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                    help="store the weights in this dtype; auto: the checkpoint's own precision (a folder's "
                         "16-bit dtype; a GGUF's tensors as the file has them, quantized blocks and all)")

    p = sub.add_parser("model-load", help="load a model over the fellows")
    p.add_argument("model")
    p.add_argument("--num-stages", type=int)
    p.add_argument("--fellow-id", type=int, help="serve on this one fellow (with --num-stages 1)")
    p.add_argument("--quantization", choices=KINDS,
                   help="hold the weights at 8 or 4 bits (each fellow quantizes its own layers), or gguf: compute on "
                        "a GGUF model's own quantized blocks; default gguf for a model imported from a .gguf file, "
                        "none otherwise")
    p.add_argument("--context-tokens", type=int, metavar="N",
                   help="serve at most N tokens of conversation (prompt and reply) and budget the KV cache for that; "
                        "default: the model's own context (capped by SWARM_SERVE_CONTEXT_TOKENS where set)")
    p.add_argument("--kv-cache", choices=KV_KINDS,
                   help="how the stages hold keys and values: auto (their compute dtype), f32, f16, or q8 (8 bits "
                        "with a scale per 32 values: about half of f16); default SWARM_SERVE_KV_CACHE")
    p.add_argument("--no-wait", action="store_true", help="return once the load has started")
    _leader_options(p)

    p = sub.add_parser("plan", help="predict a model's speed on the pool before loading it")
    p.add_argument("model")
    p.add_argument("--num-stages", type=int)
    _leader_options(p)

    p = sub.add_parser("model-unload", help="unload a model and free the fellows' memory")
    p.add_argument("model")
    _leader_options(p)

    p = sub.add_parser("models", help="list the models and their status")
    _leader_options(p)

    p = sub.add_parser("infer", help="stream a reply from a served model, then its speed line")
    p.add_argument("model")
    p.add_argument("prompt", help="the message; - reads it from stdin")
    p.add_argument("--system", metavar="S", help="a system message before it")
    p.add_argument("--temperature", type=float, help="randomness; 0 is greedy (default: the model's)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int, help="0 is off")
    p.add_argument("--min-p", type=float)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--no-reasoning", action="store_true", help="ask a reasoning model to answer without thinking")
    _leader_options(p)

    cli_admin.add_parser(sub, _leader_options)

    p = sub.add_parser("demo", help="a leader and fellows on this machine with the built-in model")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--no-browser", action="store_true")
    p.add_argument("--data-dir", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "httpcore", "hypercorn.access", "trio-websocket"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return _dispatch(args) or 0
    except SwarmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(args) -> int | None:
    settings = Settings.from_env()
    if args.command == "leader":
        from swarm.leader.main import run_leader

        run_leader(args.host, args.port, args.data_dir or settings.data_dir or default_data_dir("leader"), settings,
                   args.tls_cert, args.tls_key)
    elif args.command == "join":
        # Before torch loads (OpenMP reads it once); a user's own setting wins.
        for name, value in FELLOW_THREAD_ENV.items():
            os.environ.setdefault(name, value)
        from swarm.fellow import run_fellow
        from swarm.fellow.process import check_fellow

        data_dir = args.data_dir or settings.data_dir or default_data_dir("fellow")
        if args.check:
            check_fellow(args.url, args.token, data_dir, args.name)
        else:
            run_fellow(args.url, args.token, data_dir, args.name, args.standby)
    elif args.command == "leave":
        from swarm.fellow.process import leave_fellow

        leave_fellow(args.data_dir or settings.data_dir or default_data_dir("fellow"), args.force)
    elif args.command == "update":
        from swarm.fellow.process import update_fellow

        update_fellow(args.data_dir or settings.data_dir or default_data_dir("fellow"), args.force)
    elif args.command == "model":
        from swarm.model_import import import_into_leader

        data_dir = args.data_dir or settings.data_dir or default_data_dir("leader")
        manifest = import_into_leader(args.source, data_dir, args.name, replace=args.replace, show_progress=True,
                                      dtype=args.dtype, pool=args.pool)
        print(f"Imported {manifest.name}: {manifest.architecture}, {manifest.num_layers} layers, "
              f"{manifest.total_bytes / 1e9:.2f} GB "
              f"{'as the GGUF has it' if manifest.storage == 'gguf' else 'in ' + manifest.dtype}")
    elif args.command == "plan":
        from swarm.client import LeaderClient

        _plan(LeaderClient.from_options(args.leader, args.token, settings), args)
    elif args.command in ("model-load", "model-unload", "models"):
        from swarm.client import LeaderClient

        client = LeaderClient.from_options(args.leader, args.token, settings)
        if args.command == "models":
            for m in client.get("/api/v1/models")["models"]:
                print(f"{m['id']:32} {m['status']:12} {m.get('architecture')}, {m.get('num_layers')} layers")
        elif args.command == "model-unload":
            client.post(f"/api/v1/models/{args.model}/unload")
            print(f"Unloaded {args.model}")
        else:
            body = {"num_stages": args.num_stages} if args.num_stages else {}
            if args.fellow_id:
                body = {"num_stages": args.num_stages or 1, "fellow_id": args.fellow_id}
            if args.quantization:
                body["quantization"] = args.quantization
            if args.context_tokens:
                body["context_tokens"] = args.context_tokens
            if args.kv_cache:
                body["kv_cache"] = args.kv_cache
            client.post(f"/api/v1/models/{args.model}/load", body)
            if not args.no_wait:
                view = client.wait_ready(args.model, show_progress=True)
                for s in view["stages"]:
                    print(f"Stage {s['index']}: {s['fellow']} · L{s['layers'][0]}-{s['layers'][1] - 1} · "
                          f"{s['memory_bytes'] / 1e6:.0f} MB")
                if view.get("quantization") == "gguf":
                    print(f"Quantization gguf (the file's own blocks): weights {view['compression']:.1f}x smaller "
                          "than float32")
                elif view.get("quantization", "none") != "none":
                    print(f"Quantized {view['quantization']}: weights {view['compression']:.1f}x smaller")
                if view.get("context_tokens"):
                    print(f"Context: {view['context_tokens']} tokens, KV cache {view.get('kv_cache', 'auto')}")
            print(f"{args.model} is {'loading' if args.no_wait else 'ready'}")
    elif args.command == "infer":
        from swarm.client import LeaderClient

        _infer(LeaderClient.from_options(args.leader, args.token, settings), args)
    elif args.command == "admin" and args.admin_command == "migrate-db":
        cli_admin.migrate_db(args, settings)
    elif args.command == "admin":
        from swarm.client import LeaderClient

        client = LeaderClient.from_options(args.leader, args.token, settings)
        cli_admin.run(client, args)
    elif args.command == "demo":
        from swarm.demo import run_demo

        return run_demo(args.port, args.stages, not args.no_browser,
                        args.data_dir or settings.data_dir or default_data_dir("demo"))
    return None


def _plan(client, args) -> None:
    """`swarm plan MODEL [--num-stages N]`: the prediction's sentence, then each stage and link."""
    from urllib.parse import quote

    query = f"?num_stages={args.num_stages}" if args.num_stages else ""
    plan = client.get(f"/api/v1/models/{quote(args.model, safe='')}/plan{query}")
    print(f"{args.model}: {plan['text']}")
    for s in plan["stages"]:
        print(f"  stage {s['index']}: {s['fellow']} · L{s['layers'][0]}-{s['layers'][1] - 1} · "
              f"{s['decode_ms']:.1f} ms/token, prompt {s['prefill_ms'] / 1000:.2f} s")
    for link in plan["links"]:
        how = "measured" if link["rtt_measured"] else "assumed"
        print(f"  link {link['from_stage']} -> {link['to_stage']}: {link['rtt_ms']:.1f} ms round trip ({how}), "
              f"{link['bytes_per_token']:,} bytes/token")


def _infer(client, args) -> None:
    """The reply streams to stdout (its reasoning, if any, to stderr), then the speed line to stderr: measured here
    from the stream, like the chat page's, with the fellows' split from swarm.timing."""
    import time

    from swarm.client import speed_line

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise SwarmError("the prompt is empty: give it as the second argument, or pipe it in with - .")
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": prompt}]
    body: dict = {"model": args.model, "messages": messages}
    for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.no_reasoning:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    started = time.monotonic()
    first = last = None
    pieces = 0
    usage, timing, reasoning_open = None, None, False
    for chunk in client.chat_stream(body):
        usage = chunk.get("usage") or usage
        timing = (chunk.get("swarm") or {}).get("timing") or timing
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            content = delta.get("content") or ""
            if reasoning or content:
                last = time.monotonic()
                first = first or last
                pieces += 1
            if reasoning:
                print(reasoning, end="", file=sys.stderr, flush=True)
                reasoning_open = True
            if content:
                if reasoning_open:
                    print(file=sys.stderr)
                    reasoning_open = False
                print(content, end="", flush=True)
    print(flush=True)
    ended = time.monotonic()
    tokens = (usage or {}).get("completion_tokens", pieces)
    rate = None
    if first is not None and last is not None and tokens:
        # A reply that came in one burst (a buffering proxy) is rated over the whole request, as on the chat page.
        burst = last - first < 0.05 or pieces < 3
        rate = tokens / max(ended - started, 1e-3) if burst else (tokens - 1) / (last - first)
    print(speed_line(tokens, rate, first - started if first is not None else None, timing), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
