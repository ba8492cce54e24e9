"""`wcache` command line: make-checkpoint, serve, preload, bench.

``serve`` and ``preload`` share the model arguments (`add_engine_args`) so the daemon builds the
same engine configuration, and therefore the same cache key, as the engine.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from wcache import __version__
from wcache import logs
from wcache.core.checkpoint import DTYPES, PRESETS
from wcache.core.config import DTYPE_CHOICES
from wcache.model.quant import METHODS

log = logging.getLogger("wcache.cli")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weight and compute dtype; auto takes torch_dtype from config.json")
    p.add_argument("--quantization", "-q", default=None, choices=sorted(METHODS),
                   help="quantization method; default: the checkpoint's quantization_config, else none")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto picks cuda when available")
    p.add_argument("--revision", default=None, help="model revision recorded in the cache key")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "ipc_cache"],
                   help="where weights come from; ipc_cache maps them from the weight cache daemon")
    from wcache.core.ranks import add_parallel_args

    add_parallel_args(p)  # tensor/pipeline/data parallel, nodes, speculative draft
    p.add_argument("--enable-autotune", action=argparse.BooleanOptionalAction, default=True,
                   help="load the tuned projection kernels from the autotune cache, or tune and save them")


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1]")
    return v


def _size(text: str) -> int:
    from wcache.engine.memory import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wcache", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"wcache {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-checkpoint", help="write a deterministic Llama-style safetensors checkpoint")
    mk.add_argument("dir")
    mk.add_argument("--preset", default="tiny", choices=list(PRESETS))
    mk.add_argument("--tie-embeddings", action="store_true", help="lm_head shares embed_tokens")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))

    serve = sub.add_parser("serve", help="run the engine with an HTTP API")
    serve.add_argument("model", help="model directory (config.json + *.safetensors)")
    add_engine_args(serve)
    from wcache.core.ranks import add_serve_rank_args

    add_serve_rank_args(serve)
    serve.add_argument("--model-loader-extra-config", default=None, metavar="JSON",
                       help="ipc_cache loader settings as a JSON object (see the loader key table)")
    serve.add_argument("--host", default="0.0.0.0", help="address the HTTP API listens on")
    serve.add_argument("--port", type=int, default=8000,
                       help="port of the HTTP API (GET /health, POST /v1/completions); taken: exit status 2")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt plus completion, in tokens (default: the model's, at most 2048)")
    serve.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, metavar="FRACTION",
                       help="share of the device for weights (the daemon's included), activations and the "
                            "KV cache (default 0.9)")
    serve.add_argument("--cpu-memory-capacity", type=_size, default=None, metavar="SIZE",
                       help="with --device cpu: the memory that --gpu-memory-utilization is a share of, "
                            "e.g. 8GiB (default: the host's physical memory)")

    from wcache.daemon.launcher import add_preload_args

    preload = sub.add_parser("preload", help="run the weight cache daemon(s) for a model")
    preload.add_argument("--model", required=True, help="model directory")
    add_engine_args(preload)
    add_preload_args(preload)

    from wcache.bench import add_bench_args

    bench = sub.add_parser("bench", help="time weights-ready for disk, zero_copy and copy in one run")
    add_bench_args(bench)

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
    from wcache.core.config import EngineConfig
    from wcache.engine.engine import Engine
    from wcache.engine.loader import parse_loader_config
    from wcache.engine.server import EngineServer, run_until_signal

    loader_config = parse_loader_config(args.model_loader_extra_config)
    from wcache.core.ranks import needs_workers

    if needs_workers(args):  # several ranks, a data-parallel rank or a speculative draft: workers.py
        from wcache.engine.workers import run_serve

        return run_serve(args, loader_config)
    cfg = EngineConfig.build(args.model, args.dtype, args.quantization, args.device, revision=args.revision)
    # Listen before loading so /health answers 503 while weights load (readiness probes).
    server = EngineServer((args.host, args.port), None, args.model)
    log.info("Serving on http://%s:%d (health 503 until weights are loaded)", args.host, args.port)
    engine = Engine(cfg, args.load_format, loader_config, args.max_model_len,
                    gpu_memory_utilization=args.gpu_memory_utilization,
                    cpu_memory_capacity=args.cpu_memory_capacity, enable_autotune=args.enable_autotune)
    server.engine, server.ready = engine, True
    log.info("Engine ready: POST http://%s:%d/v1/completions", args.host, args.port)
    run_until_signal(server, on_stop=getattr(engine, "close", None))
    log.info("Engine stopped")
    return 0


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
