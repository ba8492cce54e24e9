"""`wcache` command line: make-checkpoint, serve, preload, bench. The flags are in flags.py."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from wcache import __version__, flags, logs

log = logging.getLogger("wcache.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wcache", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"wcache {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-checkpoint", help="write a deterministic Llama-style safetensors checkpoint")
    flags.add_make_checkpoint_args(mk)
    serve = sub.add_parser("serve", help="run the engine with an HTTP API")
    flags.add_serve_args(serve)
    preload = sub.add_parser("preload", help="run the weight cache daemon(s) for a model")
    preload.add_argument("--model", required=True, help="model directory")
    flags.add_engine_args(preload)
    flags.add_preload_args(preload)
    bench = sub.add_parser("bench", help="time weights-ready for disk, zero_copy and copy in one run")
    flags.add_bench_args(bench)

    from wcache.wait import add_wait_args

    wait = sub.add_parser("wait", help="wait until a daemon or engine started with & is ready (health URL, log line)")
    add_wait_args(wait)
    return parser


def cmd_make_checkpoint(args) -> int:
    t0 = time.perf_counter()
    from wcache.core.checkpoint import make_checkpoint

    out = make_checkpoint(args.dir, args.preset, args.tie_embeddings, args.seed, args.dtype)
    files = sorted(p.name for p in out.iterdir())
    print(f"Wrote {args.preset} checkpoint to {out} in {time.perf_counter() - t0:.1f} s: {', '.join(files)}")
    return 0


def cmd_serve(args) -> int:
    from wcache.engine.engine import run_serve
    from wcache.engine.loading.config import parse_loader_config

    return run_serve(args, parse_loader_config(args.model_loader_extra_config))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level)
    from wcache.errors import UserError

    try:
        if args.command == "make-checkpoint":
            return cmd_make_checkpoint(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "preload":
            from wcache.daemon.launcher import run_preload

            return run_preload(args)
        if args.command == "bench":
            from wcache.bench import run_bench

            return run_bench(args)
        if args.command == "wait":
            from wcache.wait import run_wait

            return run_wait(args)
    except UserError as e:
        log.error("%s", e)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
