"""Every command-line flag of ``wcache``, in one place: the command modules only read the values.

``serve`` and ``preload`` share the model and parallelism flags (``add_engine_args``) so the daemon
builds the same engine configuration, and therefore the same cache key, as the engine.
docs/configuration.md's flag table is generated from these (tools/doc_tables.py).
"""

from __future__ import annotations

import argparse

#: `wcache wait --log`'s default text: what the launcher logs once every rank serves
#: (wcache.daemon.launcher.READY; not imported from there, so `wcache wait` does not load the daemon's
#: modules). Here, not in wait.py, because a module of this package imports none of its siblings.
READY = "Weight cache daemon READY"
# `wcache wait --timeout`'s default: the ipc_cache loader's state_timeout_s (300 s, loading/config.py),
# so a wait for an engine that waits for its daemon does not give up before the engine does.
DEFAULT_TIMEOUT_S = 300.0

# The choices of the other commands' flags live beside the code that uses them, in modules that
# import torch (about 2 s); each add_* function imports what it needs, so `wcache wait`, which runs
# between every start in a script, builds its parser without them (cli.build_parser).


def add_make_checkpoint_args(p: argparse.ArgumentParser) -> None:
    from wcache.core.checkpoint import DTYPES, PRESETS

    p.add_argument("dir", help="directory to write (created if missing)")
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), help="model size (core/checkpoint.py PRESETS)")
    p.add_argument("--tie-embeddings", action="store_true", help="lm_head shares embed_tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights: the same seed, the same bytes")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="dtype of the stored weights")
    p.add_argument("--quantization", "-q", default="none", choices=["none", "fp8"],
                   help="fp8: store every decoder projection block-wise in FP8 as transformers does (float8_e4m3fn "
                        "weights, float32 weight_scale_inv per block, quantization_config in config.json)")
    p.add_argument("--weight-block-size", type=_positive, default=None, metavar="N",
                   help="FP8 block of N x N weights (default: 128; 32 for the tiny and tensors-10k presets, "
                        "whose heads are 32 wide)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from wcache.core.flag_defaults import DTYPE_CHOICES
    from wcache.core.flag_defaults import QUANTIZATION_CHOICES as CHOICES

    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weight and compute dtype; auto takes config.json's dtype (or torch_dtype), else the stored weights'")
    p.add_argument("--quantization", "-q", default=None, choices=CHOICES,
                   help="quantization method; default: the checkpoint's quantization_config, else none")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto picks cuda when available")
    p.add_argument("--revision", default=None, help="model revision recorded in the cache key")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "ipc_cache"],
                   help="where weights come from; ipc_cache maps them from the weight cache daemon")
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


def _positive(text: str) -> int:
    """A count of at least 1 (tokens, sequences, requests, connections, a block's size)."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not v > 0.0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return v


def _size(text: str) -> int:
    from wcache.core.sizes import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parallel_args(p) -> None:
    """Engine flags shared by ``serve`` and ``preload`` (so both plan the same ranks)."""
    from wcache.core.flag_defaults import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks: each holds a slice of every layer")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                   help="pipeline stages: each holds a contiguous block of layers")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="data-parallel replicas, each an engine with its own tensor/pipeline ranks")
    g.add_argument("--data-parallel-size-local", type=int, default=None, metavar="N",
                   help="data-parallel ranks on this node (default: data-parallel size / nnodes)")
    g.add_argument("--data-parallel-start-rank", type=int, default=None, metavar="R",
                   help="first data-parallel rank on this node (default: node rank x size-local)")
    g.add_argument("--data-parallel-address", default=None, metavar="HOST",
                   help="rendezvous address when data-parallel ranks span nodes (default: --master-addr)")
    g.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes the ranks are spread over")
    g.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's index, 0 to nnodes-1")
    g.add_argument("--master-addr", default=DEFAULT_MASTER_ADDR, metavar="HOST",
                   help="address of the node that holds global rank 0")
    g.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT, metavar="PORT",
                   help="the engine's rendezvous port (the daemons use --weight-cache-master-port)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. {"method": "eagle", "model": DIR, "num_speculative_tokens": 3}')


def add_serve_rank_args(p) -> None:
    p.add_argument("--data-parallel-rank", "-dpr", type=int, default=None, metavar="R",
                   help="the data-parallel rank this engine serves (required with --data-parallel-size > 1)")


def add_daemon_port_args(g) -> None:
    g.add_argument("--weight-cache-master-port", type=int, default=None, metavar="PORT",
                   help="rendezvous port of the daemons' own process group; must differ from the engine's "
                        "--master-port and match on every node (required when the daemons span nodes; "
                        "default: a free port)")
    g.add_argument("--weight-cache-draft-master-port", type=int, default=None, metavar="PORT",
                   help="rendezvous port of the draft daemon group (default: --weight-cache-master-port + 1 "
                        "across nodes, else a free port)")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from wcache.core.flag_defaults import DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_WAITING_REQUESTS

    # vLLM's serve takes the model both ways: `vllm serve DIR` and `vllm serve --model DIR`.
    p.add_argument("model", nargs="?", default=None, help="model directory (config.json + *.safetensors)")
    p.add_argument("--model", dest="model_flag", default=None, metavar="DIR",
                   help="the model directory as a flag, as vLLM's serve also accepts (give it once)")
    add_engine_args(p)
    add_serve_rank_args(p)
    p.add_argument("--model-loader-extra-config", default=None, metavar="JSON",
                   help="ipc_cache loader settings as a JSON object (see the loader key table)")
    p.add_argument("--host", default="0.0.0.0",
                   help="address the HTTP API listens on; without --api-key the API has no authentication: "
                        "0.0.0.0 answers anyone who can reach this host, 127.0.0.1 this host only")
    p.add_argument("--port", type=int, default=8000,
                   help="port of the HTTP API (GET /health, POST /v1/completions); taken: exit status 2")
    p.add_argument("--respawn", action="store_true",
                   help="keep the listening socket in a supervisor and a hot spare worker ready (context, weights "
                        "and a warm-up forward; no KV cache); when the serving worker dies, the spare takes over the same socket, so "
                        "clients wait instead of being refused (one-rank engines; docs/respawn.md)")
    p.add_argument("--respawn-heartbeat-timeout", type=_positive_float, default=5.0, metavar="SECONDS",
                   help="with --respawn: a serving worker silent this long (stopped, or one forward pass stuck "
                        "for half of it) is killed with SIGKILL and replaced as after a crash")
    p.add_argument("--max-model-len", type=_positive, default=None,
                   help="longest prompt plus completion, in tokens (default: the model's, at most 2048)")
    p.add_argument("--max-num-seqs", type=_positive, default=DEFAULT_MAX_NUM_SEQS, metavar="N",
                   help="sequences decoded together in one batch (continuous batching); each holds a KV cache slot "
                        "of --max-model-len tokens, so the engine lowers it to what the memory budget holds")
    p.add_argument("--enforce-eager", action="store_true",
                   help="GPU: run every decode step eagerly instead of replaying CUDA graphs of it (the same "
                        "tokens, more host time per step)")
    p.add_argument("--max-waiting-requests", type=_positive, default=DEFAULT_MAX_WAITING_REQUESTS, metavar="N",
                   help="requests that may wait for a batch slot; past it a request is refused at once with "
                        "503 and Retry-After")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, metavar="FRACTION",
                   help="share of the device's total memory for weights (the daemon's included), activations "
                        "and the KV cache; memory other processes hold is not counted and must fit in the rest "
                        "(on a GPU the engine refuses to start when it does not)")
    p.add_argument("--cpu-memory-capacity", type=_size, default=None, metavar="SIZE",
                   help="with --device cpu: the memory that --gpu-memory-utilization is a share of, "
                        "e.g. 8GiB (default: the host's physical memory)")
    add_api_args(p)
    add_http_args(p)


def add_api_args(p) -> None:
    """What the HTTP API answers to (vLLM's flags): names, chat template, API key (engine/api_server/served.py)."""
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) the API answers to: a request's model may be any of them, answers "
                        "carry the first (default: the model directory as given)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="chat template for POST /v1/chat/completions: a Jinja file, or the template text itself "
                        "(default: the checkpoint's chat_template.jinja, else tokenizer_config.json's)")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require one of these keys as Authorization: Bearer KEY on /v1/ routes (default: "
                        "$VLLM_API_KEY; the variable keeps the key out of ps)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory of the tokenizer (tokenizer.json, tokenizer_config.json) when it is not the "
                        "model directory's; the chat template comes from there too (chat_template.jinja, else "
                        "tokenizer_config.json's), unless --chat-template gives one")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: prompts must be token ids, and completions carry no text (their "
                        "token ids are counted in usage)")
    p.add_argument("--generation-config", default="auto", metavar="DIR",
                   help="where the stop ids (eos_token_id) come from: auto, the model directory's "
                        "generation_config.json (else config.json's); vllm, none but the tokenizer's EOS; or a "
                        "directory holding a generation_config.json")
    from wcache.engine.openai import template_sandbox  # the standard library only

    p.add_argument("--chat-template-render-timeout", type=_positive_float, default=template_sandbox.DEFAULT_TIMEOUT_S,
                   metavar="SECONDS",
                   help="stop a chat template render after this long and answer 400 (the render runs in a worker "
                        f"process of at most {template_sandbox.RENDER_MEMORY_BYTES >> 20} MiB)")


def add_http_args(p) -> None:
    """The HTTP server's operation: its completion limit, its request log and its SIGTERM drain
    (engine/api_server/http_front.py, access_log.py, drain.py; docs/lifecycle.md says why these defaults)."""
    g = p.add_argument_group("HTTP server and shutdown")
    g.add_argument("--max-concurrent-connections", type=_positive, default=64, metavar="N",
                   help="connections working on a request at once (completions, models); past it a 503. "
                        "/health, /metrics and /version are answered apart from this limit")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="do not write the one-line access log per request (request id, method, path, status, "
                        "tokens, time to first token, total time), at INFO on wcache.access")
    g.add_argument("--shutdown-delay", type=_seconds, default=5.0, metavar="SECONDS",
                   help="after SIGTERM, keep accepting this long (/health answers 503 from the start) so load "
                        "balancers withdraw the endpoint first")
    g.add_argument("--shutdown-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                   help="then drain in-flight requests for up to this long; what still runs ends with an error "
                        "and the engine exits 0")


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return v


def add_preload_command_args(p) -> None:
    """`wcache preload`: the model, the engine's flags (the same cache key) and the daemon's own."""
    p.add_argument("--model", default=None, help="model directory (required)")
    # Caught so that `wcache preload DIR` says how preload takes its model (cli.resolve_model).
    p.add_argument("model_positional", nargs="?", default=None, help=argparse.SUPPRESS)
    add_engine_args(p)
    add_preload_args(p)


def add_preload_args(p) -> None:
    g = p.add_argument_group("weight cache daemon")
    g.add_argument("--weight-cache-socket-dir", default=None, metavar="DIR",
                   help="directory for the daemon sockets; engines must use the same (default: $TMPDIR/wcache_<uid>)")
    g.add_argument("--weight-cache-health-port", type=int, default=None, metavar="PORT",
                   help="serve GET /health on this port: 200 once every rank serves, else 503 (default: off)")
    g.add_argument("--weight-cache-health-host", default="0.0.0.0", metavar="HOST",
                   help="address for the health endpoint (no authentication; it says only whether the "
                        "ranks serve)")
    g.add_argument("--weight-cache-transport", default="auto", choices=["auto", "cuda_ipc", "vmm_fd"],
                   help="how GPU weights are shared: vmm_fd (a CUDA VMM allocation passed as a file descriptor; "
                        "crosses container namespaces), cuda_ipc (legacy CUDA IPC handle), or auto (vmm_fd when "
                        "the CUDA driver, libcuda.so.1, offers the VMM calls, else cuda_ipc); CPU always uses a memfd")
    g.add_argument("--weight-cache-adopt", default=True, action=argparse.BooleanOptionalAction,
                   help="before loading, take the weights back from a running zero_copy engine whose daemon "
                        "died (memfd and vmm_fd arenas; see docs/lifecycle.md, A restarted daemon takes the weights back)")
    g.add_argument("--weight-cache-standby", default=False, action="store_true",
                   help="if a running daemon owns this device, wait for it to stop and take over then, with "
                        "Python and torch already imported; without it such a start exits 2 "
                        "(default: off; see docs/lifecycle.md, A standby daemon)")
    g.add_argument("--weight-cache-stop-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or SIGINT, how long each rank may take to stop before SIGKILL; the launcher "
                        "then removes a killed rank's socket if nothing listens there (keep it below Kubernetes' "
                        "terminationGracePeriodSeconds)")
    g.add_argument("--weight-cache-rehash", default=False, action="store_true",
                   help="hash every checkpoint file on this start instead of reusing the digests remembered "
                        "by file identity (for a change that no file time shows, e.g. one written below the filesystem)")
    add_daemon_port_args(g)
    s = p.add_argument_group("autotune seeding (see docs/autotune.md)")
    s.add_argument("--weight-cache-seed-listen", default=None, metavar="HOST:BASE_PORT",
                   help="serve this daemon's tuned autotune cache to new replicas; rank g listens on "
                        "BASE_PORT + g (needs --weight-cache-seed-token)")
    s.add_argument("--weight-cache-seed-token", default=None, metavar="TOKEN",
                   help="shared secret of a seed and its replicas, at least 16 characters "
                        "(default: $WCACHE_SEED_TOKEN)")
    s.add_argument("--weight-cache-seed", default=None, metavar="HOST:PORT[,...]",
                   help="pull the autotune cache from a running daemon before tuning: one address per "
                        "local rank, in local rank order")
    s.add_argument("--weight-cache-seed-weights", default="auto", choices=["auto", "always", "never"],
                   help="with --weight-cache-seed, also take the weights from that daemon: auto when the model "
                        "directory has no shards, always (even with shards: a network faster than the disk), never "
                        "(see docs/seeding-replicas.md)")
    s.add_argument("--weight-cache-seed-round-window", type=float, default=None, metavar="SECONDS",
                   help="a seed daemon gathers the replicas that ask for weights within this many seconds of the "
                        "first into one fan-out round (default: 2)")
    s.add_argument("--weight-cache-seed-round-replicas", type=int, default=None, metavar="N",
                   help="a seed daemon starts a fan-out round as soon as N replicas have asked for weights, "
                        "without waiting out --weight-cache-seed-round-window (default: the window always)")
    s.add_argument("--weight-cache-seed-stall-timeout", type=float, default=None, metavar="SECONDS",
                   help="a replica gives up on a seed daemon that sends nothing for this long (default: 30)")


def _quantization_choices() -> list[str]:
    from wcache.model.quant import CHOICES

    return CHOICES


def add_bench_args(p) -> None:
    p.add_argument("--model", required=True, help="model directory to time")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="auto picks cuda when available")
    p.add_argument("--dtype", default="auto", help="as serve's --dtype")
    p.add_argument("--quantization", "-q", default=None, choices=_quantization_choices(),
                   help="as serve's --quantization, for the daemon and every engine (e.g. fp8: the daemon "
                        "quantizes once, a disk start quantizes on every start)")
    p.add_argument("--transport", default="auto", choices=["auto", "cuda_ipc", "vmm_fd"],
                   help="the daemon's --weight-cache-transport (CUDA only)")
    p.add_argument("--repeat", type=int, default=3, help="samples per source; the median is reported")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    p.add_argument("--output", default=None, help="also write the JSON result to this file")
    p.add_argument("--respawn", action="store_true",
                   help="instead: kill the serving worker of `wcache serve --respawn` under a steady client, "
                        "against a fresh `wcache serve` from disk (wcache/bench/respawn.py)")
    p.add_argument("--health-under-load", action="store_true",
                   help="instead: GET /health latency (p50, p99, max over 200 probes) while 200 completion "
                        "connections are held open and 16 streams run (bench/health.py)")
    p.add_argument("--seed", action="store_true",
                   help="instead: weight seeding from a running daemon against a raw TCP copy of the same bytes, "
                        "one replica against --seed-replicas at once, and against a disk start (bench/seeding.py)")
    p.add_argument("--seed-replicas", type=int, default=4,
                   help="with --seed: replicas of the fan-out round (0: no round, for one GPU that holds a "
                        "source and one replica of the model but not more)")
    p.add_argument("--seed-window", type=float, default=3.0,
                   help="with --seed: the fan-out source's --weight-cache-seed-round-window (its "
                        "--weight-cache-seed-round-replicas is --seed-replicas)")


def add_wait_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--health", action="append", default=[], metavar="URL",
                   help="wait until GET URL answers 200, e.g. http://127.0.0.1:8000/health (repeatable)")
    p.add_argument("--log", action="append", default=[], metavar="FILE",
                   help=f"wait until FILE contains --text (default: {READY!r}) (repeatable)")
    p.add_argument("--text", default=READY, help="the text --log waits for")
    p.add_argument("--pid", type=int, default=None,
                   help="fail at once if this process exits before everything is ready (e.g. $!)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="give up after this many seconds; a large model's daemon may need more")
