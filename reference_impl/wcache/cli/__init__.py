"""wcache: a GPU weight cache and a small engine (make-checkpoint, serve, preload, bench, wait).

The command line's package: the flags of every command are in flags.py, the parser that reads them
in parser.py and `wcache wait` in wait.py; this module, the entry point (``wcache`` and ``python -m
wcache.cli``), picks the command and runs it. It imports its own modules, so they import none of
each other (a module of this package that imported a sibling would load this one first: a loop).

argparse's namespace stops here: each command gets its typed settings, built once from it
(core/settings.py); no module outside cli/ reads the namespace (tests/unit/test_no_namespace.py).
"""

from __future__ import annotations

import logging
import sys
import time

from wcache import __version__, logs
from wcache.cli import flags
from wcache.cli.parser import Parser
from wcache.core import no_dump

log = logging.getLogger("wcache.cli")


#: Each command: its help line and the flags.py function that adds its flags.
COMMANDS = {
    "make-checkpoint": ("write a deterministic Llama-style safetensors checkpoint", flags.add_make_checkpoint_args),
    "serve": ("run the engine with an HTTP API", flags.add_serve_args),
    "preload": ("run the weight cache daemon(s) for a model", flags.add_preload_command_args),
    "bench": ("time weights-ready for disk, zero_copy and copy in one run", flags.add_bench_args),
    "wait": ("wait until a daemon or engine started with & is ready (health URL, log line)", flags.add_wait_args),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or only of ``command`` when it names one: adding a command's
    flags imports what their choices need, torch included, which `wcache wait` does not."""
    parser = Parser(prog="wcache", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"wcache {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_args) in COMMANDS.items():
        if command in COMMANDS and name != command:
            continue
        add_args(sub.add_parser(name, help=help_text))
    return parser


def command_named(argv: list[str]) -> str | None:
    """The command in ``argv`` without parsing it: the first word that is not a global flag or
    --log-level's value."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def resolve_model(args) -> None:
    """``args.model`` from wherever the command takes it (errors.ModelArgumentError says where)."""
    from wcache.errors import ModelArgumentError as E

    if args.command == "serve":
        if args.model and args.model_flag and args.model != args.model_flag:
            raise E(E.SERVE_TWICE.format(positional=args.model, flag=args.model_flag))
        args.model = args.model or args.model_flag
        if not args.model:
            raise E(E.SERVE_MISSING)
    elif args.command == "preload":
        if args.model_positional is not None:
            raise E(E.PRELOAD_POSITIONAL.format(positional=args.model_positional))
        if not args.model:
            raise E(E.PRELOAD_MISSING)


def cmd_make_checkpoint(args) -> int:
    t0 = time.perf_counter()
    from wcache.core.checkpoint import make_checkpoint

    from wcache.errors import QuantizationError

    if args.weight_block_size is not None and args.quantization != "fp8":
        raise QuantizationError(QuantizationError.BLOCK_WITHOUT_FP8)
    out = make_checkpoint(args.dir, args.preset, args.tie_embeddings, args.seed, args.dtype,
                          quantization=args.quantization, weight_block_size=args.weight_block_size)
    files = sorted(p.name for p in out.iterdir())
    print(f"Wrote {args.preset} checkpoint to {out} in {time.perf_counter() - t0:.1f} s: {', '.join(files)}")
    return 0


def cmd_serve(args) -> int:
    # No torch in these two: the front (below) holds the settings too.
    from wcache.core.settings import from_flags
    from wcache.engine.api_server.settings import ServeSettings

    settings = from_flags(ServeSettings, args)
    if _two_processes():  # the front: no torch here (engine/api_server/front.py)
        from wcache.engine.api_server.front import run_front

        return run_front(settings)
    from wcache.engine.serve import run_serve
    from wcache.engine.loading.config import parse_loader_config

    loader_config = parse_loader_config(settings.core.model_loader_extra_config)
    if settings.core.respawn:
        from wcache.engine.respawn.respawn import run_respawn

        return run_respawn(settings, loader_config)
    return run_serve(settings, loader_config)


def cmd_bench(args) -> int:
    """`wcache bench`: the measurement its flags pick, with the run's settings."""
    from wcache.bench.settings import BenchSettings
    from wcache.core.settings import from_flags

    settings = from_flags(BenchSettings, args)
    if args.health_under_load:
        from wcache.bench.health import run_bench_health

        return run_bench_health(settings)
    if args.seed:
        from wcache.bench.seeding import run_bench_seed

        return run_bench_seed(settings)
    if args.respawn:
        from wcache.bench.respawn import run_bench_respawn

        return run_bench_respawn(settings)
    from wcache.bench.run import run_bench

    return run_bench(settings)


def _two_processes() -> bool:
    """`wcache serve` as a front and an engine core (engine/api_server/front.py says when)."""
    from wcache.engine.api_server.front import enabled

    return enabled()


def main(argv: list[str] | None = None) -> int:
    no_dump.forbid()  # the engine's and the launcher's memory, sockets and keys: see core/no_dump.py
    argv = sys.argv[1:] if argv is None else argv
    command = command_named(argv)
    if command == "serve":
        from wcache.errors import MultiprocessingEnvError

        try:
            two = _two_processes()
        except MultiprocessingEnvError as e:  # before any flag is read: the layout decides what imports
            logs.setup()
            log.error("%s", e)
            return 2
        if not two:  # the CUDA context is made while the engine imports (early_context.py); a front
            # leaves the device to its engine core
            from wcache.engine.worker import early_context

            early_context.start(argv)
    if command != "preload" or {"-h", "--help"} & set(argv):
        return _main(argv, command)
    # The first daemon rank imports torch while this process imports and plans (without torch):
    # see daemon/prewarm.py. A rank not handed its spec is killed on the way out.
    from wcache.daemon import prewarm

    prewarm.start()
    try:
        return _main(argv, command)
    finally:
        prewarm.discard()


def _main(argv: list[str], command: str | None) -> int:
    args = build_parser(command).parse_args(argv)
    logs.setup(args.log_level)
    from wcache.errors import UserError

    try:
        resolve_model(args)
        if args.command == "make-checkpoint":
            return cmd_make_checkpoint(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "preload":
            from wcache.core.settings import from_flags
            from wcache.daemon.launcher import PreloadSettings, run_preload

            return run_preload(from_flags(PreloadSettings, args))
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "wait":
            from wcache.cli.wait import run_wait

            return run_wait(args)
    except UserError as e:
        log.error("%s", e)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1
