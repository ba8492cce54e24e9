"""The autotune pass: time every implementation the engine can run for each projection shape of this
rank, keep the fastest, and cache the winners on disk so the next process skips the benchmark.

What is tuned. Each decoder layer has four projections (``model.Linear``): fused q/k/v, attention
output, fused gate/up and down, with this rank's tensor-parallel shapes. For each distinct
(out_features, in_features) and each token count of ``TOKEN_BUCKETS`` (1 = a decode step, 16 = a
short prefill) every candidate of ``candidates(device)`` runs on random inputs of the compute dtype.
All candidates compute ``x @ w.T`` with the stored weight as it is: none needs a second copy or
another layout of the weights, so a winner never costs memory. One benchmarked (shape, token count,
candidate) is one *trial*; ``TRIALS`` counts them in this process, and a warm start has none.

A candidate's output is compared with ``F.linear`` before it is timed; one that disagrees is
dropped (and logged), so whichever candidate wins, the model computes the same function. A
non-default candidate must beat ``linear`` by ``MIN_GAIN`` to be chosen, so timing noise does not
flip the choice. Applying a cache is deterministic: the winner recorded for a shape and token
bucket is used, whatever the timings on this machine.

The cache. One JSON file per rank in ``cache_dir()`` (``$WCACHE_AUTOTUNE_CACHE_DIR``, else
``<cache root>/autotune``), named by ``key_hash(tune_key(cfg))``: a hash of everything that can
change a result (model shapes of this rank, dtype, quantization, TP/PP size and rank, device kind,
architecture and name, torch and wcache versions, the candidate set). The daemon and the engine call
the same function, so they name the same file. Writes are atomic (temp file + ``os.replace``): a
reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from wcache import __version__
from wcache.core.config import EngineConfig
from wcache.core.fingerprint import mismatched_fields

log = logging.getLogger("wcache.autotune")

FORMAT = "wcache-autotune"
AUTOTUNE_VERSION = 1
TOKEN_BUCKETS = (1, 16)
PROJECTIONS = ("qkv", "o", "gate_up", "down")
MIN_GAIN = 0.05  # a candidate other than `linear` must be at least 5% faster
MAX_CACHE_BYTES = 1 << 20  # a cache file (and a seeded one) is a few KB; refuse anything larger
DEFAULT = "linear"

LOADED = "[Autotuner]: Loaded {n} configs from {path}"
TUNED = "[Autotuner]: Tuned {n} configs in {seconds:.2f} s ({trials} trials); saved to {path}"
TRIALS_LINE = "[Autotuner]: {trials} tuning trials in this process"

TRIALS = 0  # benchmarked (shape, token count, candidate) triples in this process


class AutotuneError(Exception):
    """The pass could not produce or save a cache (fatal in the daemon, a warning in the engine)."""


# -- candidates ----------------------------------------------------------------------------------
def _linear(x, w):
    return F.linear(x, w)


def _matmul_t(x, w):
    return torch.matmul(x, w.t())


def _einsum(x, w):
    return torch.einsum("tk,nk->tn", x, w)


def _chunked(parts: int):
    def run(x, w):
        # Row blocks of w are contiguous views: no copy of the weight, only of the output.
        return torch.cat([F.linear(x, c) for c in w.chunk(parts, dim=0)], dim=-1)

    return run


def _with_blas(backend: str):
    def run(x, w):
        old = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(backend)
        try:
            return F.linear(x, w)
        finally:
            torch.backends.cuda.preferred_blas_library(old)

    return run


def _full_precision_reduction(x, w):
    m = torch.backends.cuda.matmul
    attr = "allow_bf16_reduced_precision_reduction" if x.dtype == torch.bfloat16 else "allow_fp16_reduced_precision_reduction"
    old = getattr(m, attr)
    setattr(m, attr, False)
    try:
        return F.linear(x, w)
    finally:
        setattr(m, attr, old)


CPU_CANDIDATES = {"linear": _linear, "matmul_t": _matmul_t, "einsum": _einsum,
                  "chunked2": _chunked(2), "chunked4": _chunked(4)}
# On CUDA: the same plus cuBLASLt vs cuBLAS for the GEMM, and cuBLAS without reduced-precision
# reductions (bf16/fp16 split-K reductions in full precision).
CUDA_CANDIDATES = {**CPU_CANDIDATES, "cublaslt": _with_blas("cublaslt"), "cublas": _with_blas("cublas"),
                   "full_reduction": _full_precision_reduction}
ALL = {**CPU_CANDIDATES, **CUDA_CANDIDATES}


def candidates(device: str) -> dict:
    return CUDA_CANDIDATES if device == "cuda" else CPU_CANDIDATES


# -- what is tuned, and the file it goes to ------------------------------------------------------
def projection_shapes(cfg: EngineConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of this rank's four projections; none on a stage without layers."""
    s = cfg.shape
    if not len(s.layer_range):
        return {}
    heads, kv, hd = s.num_heads // s.tp_size, s.num_kv_heads // s.tp_size, s.head_dim
    inter = s.intermediate_size // s.tp_size
    return {"qkv": ((heads + 2 * kv) * hd, s.hidden_size), "o": (s.hidden_size, heads * hd),
            "gate_up": (2 * inter, s.hidden_size), "down": (s.hidden_size, inter)}


def config_name(proj: str, n: int, k: int, m: int) -> str:
    return f"{proj}:N={n},K={k},M={m}"


def _device_name(cfg: EngineConfig) -> str:
    if cfg.device == "cuda":
        return torch.cuda.get_device_name(cfg.torch_device)
    return cpu_name()


def cpu_name() -> str:
    """The host CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def tune_key(cfg: EngineConfig) -> dict:
    """Everything that can change a tuning result. DP rank and local rank are left out on purpose:
    DP replicas run the same shapes, so they share (and may seed) one file."""
    from wcache.core.device import (
        device_arch,  # torch.cuda queries; import late like the rest of device use
    )

    s, r = cfg.shape, cfg.ranks
    return {
        "format": FORMAT, "autotune_version": AUTOTUNE_VERSION, "wcache_version": __version__,
        "torch_version": torch.__version__,
        "architecture": ",".join(cfg.hf.get("architectures", [])) or cfg.hf.get("model_type", ""),
        "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "num_heads": s.num_heads, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
        "dtype": cfg.dtype_name, "quantization": cfg.quant.name,
        "quantization_config": cfg.quant.config_hash(),
        "tp_size": r.tp_size, "tp_rank": r.tp_rank, "pp_size": r.pp_size, "pp_rank": r.pp_rank,
        "layers": [s.layer_range.start, s.layer_range.stop],
        "device_kind": cfg.device, "device_arch": device_arch(cfg.device, r.local_rank),
        "device_name": _device_name(cfg),
        "token_buckets": list(TOKEN_BUCKETS), "candidates": sorted(candidates(cfg.device)),
    }


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def cache_dir() -> Path:
    override = os.environ.get("WCACHE_AUTOTUNE_CACHE_DIR")
    if override:
        return Path(override)
    from wcache.core.fingerprint import cache_root

    return cache_root() / "autotune"


def cache_path(cfg: EngineConfig, key: dict | None = None) -> Path:
    return cache_dir() / f"{key_hash(key or tune_key(cfg))}.json"


def validate(doc, key: dict) -> dict:
    """``doc`` itself if it is a well-formed cache document made for ``key``; else AutotuneError."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise AutotuneError("not a wcache autotune cache")
    if not isinstance(doc.get("key"), dict):
        raise AutotuneError("the cache has no key")
    fields = mismatched_fields(key, doc["key"])
    if fields:
        raise AutotuneError(f"made for another configuration (fields {fields})")
    configs = doc.get("configs")
    if not isinstance(configs, dict) or not configs:
        raise AutotuneError("the cache holds no configs")
    known = candidates(key.get("device_kind", "cpu"))
    for name, c in configs.items():
        if not isinstance(c, dict) or c.get("impl") not in known:
            raise AutotuneError(f"config {str(name)[:80]!r} names no known implementation")
    return doc


def load(path: Path, key: dict) -> dict | None:
    """The cache document at ``path`` if it is valid for ``key``; None if missing; AutotuneError if bad."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    except OSError as e:
        raise AutotuneError(f"cannot read {path}: {e}") from None
    if size > MAX_CACHE_BYTES:
        raise AutotuneError(f"{path} is {size} bytes, more than the {MAX_CACHE_BYTES} an autotune cache may have")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AutotuneError(f"cannot read {path}: {e}") from None
    return validate(doc, key)


def save(path: Path, doc: dict) -> None:
    """Atomic write: a temp file in the same directory, then os.replace. Raises AutotuneError."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise AutotuneError(f"cannot write {path}: {e}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


# -- the benchmark ------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_all(fns: dict, x, w, device: torch.device, min_rounds: int = 5, max_rounds: int = 25,
              budget_s: float = 0.1) -> dict[str, float]:
    """Fastest single-call time (us) of each candidate. Candidates take turns, one call each per
    round, so a slow spell of the machine hits them all alike; the minimum over rounds is what the
    hardware can do when nothing interferes."""
    best = {name: float("inf") for name in fns}
    start = time.perf_counter()
    for r in range(max_rounds):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn(x, w)
            _sync(device)
            best[name] = min(best[name], time.perf_counter() - t0)
        if r + 1 >= min_rounds and time.perf_counter() - start > budget_s:
            break
    return {name: round(t * 1e6, 3) for name, t in best.items()}


def tolerance(dtype: torch.dtype) -> dict:
    return {"rtol": 2e-2, "atol": 2e-2} if dtype in (torch.bfloat16, torch.float16) else {"rtol": 1e-4, "atol": 1e-4}


@torch.inference_mode()
def tune(cfg: EngineConfig) -> dict:
    """Benchmark every candidate for every projection shape and token bucket; a cache document."""
    global TRIALS
    device, dtype = cfg.torch_device, cfg.dtype
    cands = candidates(cfg.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    configs: dict[str, dict] = {}
    trials = 0
    t0 = time.perf_counter()
    done: dict[tuple[int, int, int], dict] = {}
    for proj, (n, k) in projection_shapes(cfg).items():
        w = None
        for m in TOKEN_BUCKETS:
            if (n, k, m) in done:  # e.g. o and down share a shape when intermediate == hidden
                configs[config_name(proj, n, k, m)] = done[(n, k, m)]
                continue
            if w is None:
                w = (torch.randn(n, k, generator=gen) / k**0.5).to(device=device, dtype=dtype)
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
            ref = F.linear(x, w).float()
            usable = {}
            for name, fn in cands.items():
                trials += 1
                TRIALS += 1
                try:
                    out = fn(x, w)  # also the warm-up call
                except Exception as e:  # noqa: BLE001 - e.g. a BLAS backend this build lacks: not a candidate here
                    log.debug("candidate %s unavailable for %s: %s", name, config_name(proj, n, k, m), e)
                    continue
                if out.shape != ref.shape or not torch.allclose(out.float(), ref, **tolerance(dtype)):
                    log.warning("[Autotuner]: candidate %s disagrees with F.linear on %s; not used",
                                name, config_name(proj, n, k, m))
                    continue
                usable[name] = fn
            times = _time_all(usable, x, w, device)
            if DEFAULT not in times:
                raise AutotuneError(f"F.linear failed on {config_name(proj, n, k, m)}")
            best = min(times, key=lambda c: (times[c], c != DEFAULT))
            if best != DEFAULT and times[best] > times[DEFAULT] * (1 - MIN_GAIN):
                best = DEFAULT
            done[(n, k, m)] = configs[config_name(proj, n, k, m)] = {"impl": best, "us": times}
        del w
    if cfg.device == "cuda":
        torch.cuda.empty_cache()  # the random test weights were transient
    return {"format": FORMAT, "key": tune_key(cfg), "configs": configs, "trials": trials,
            "seconds": round(time.perf_counter() - t0, 3), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def load_or_tune(cfg: EngineConfig, who: str, save_errors_fatal: bool = True) -> tuple[dict, Path, int]:
    """(cache document, path, trials of this call): the cached winners if valid, else a fresh
    tuning pass that is saved. A failed save raises AutotuneError if ``save_errors_fatal``, else
    is a warning."""
    key = tune_key(cfg)
    path = cache_path(cfg, key)
    try:
        doc = load(path, key)
    except AutotuneError as e:
        log.warning("[Autotuner]: ignoring %s: %s; tuning again", path, e)
        doc = None
    if doc is not None:
        log.info(LOADED.format(n=len(doc["configs"]), path=path))
        return doc, path, 0
    doc = tune(cfg)
    doc["created_by"] = who
    try:
        save(path, doc)
    except AutotuneError as e:
        if save_errors_fatal:
            raise
        log.warning("[Autotuner]: tuned %d configs but %s; the next start tunes again", len(doc["configs"]), e)
    else:
        log.info(TUNED.format(n=len(doc["configs"]), seconds=doc["seconds"], trials=doc["trials"], path=path))
    return doc, path, doc["trials"]


# -- applying winners ------------------------------------------------------------------------------
class Selected:
    """A Linear's implementation chosen per token count: the winner of the largest bucket <= T."""

    def __init__(self, by_bucket: dict[int, str]):
        self.by_bucket = sorted(by_bucket.items())
        self.fns = [(m, ALL[name]) for m, name in self.by_bucket]

    def __call__(self, x, w):
        t = x.shape[0] if x.dim() > 1 else 1
        fn = self.fns[0][1]
        for m, f in self.fns:
            if t >= m:
                fn = f
        return fn(x, w)

    def __repr__(self) -> str:
        return "Selected(" + ", ".join(f"T>={m}: {n}" for m, n in self.by_bucket) + ")"


def choose(configs: dict, proj: str, n: int, k: int):
    """(value for Linear.impl, label): F.linear's name when it wins every bucket, the winner's
    function when one candidate wins every bucket, else a Selected."""
    by_bucket = {m: configs[config_name(proj, n, k, m)]["impl"]
                 for m in TOKEN_BUCKETS if config_name(proj, n, k, m) in configs}
    names = set(by_bucket.values())
    if not names or names == {DEFAULT}:
        return DEFAULT, DEFAULT
    if len(names) == 1:
        name = names.pop()
        return ALL[name], name
    sel = Selected(by_bucket)
    return sel, "+".join(n for _, n in sel.by_bucket)


def apply(model, configs: dict) -> dict[str, int]:
    """Set each projection's ``impl`` from the winners; returns how many projections use each."""
    from wcache.model.llama import Linear

    used: dict[str, int] = {}
    for block in model.layers.values():
        for proj, lin in (("qkv", block.attn.qkv), ("o", block.attn.o), ("gate_up", block.mlp.gate_up),
                          ("down", block.mlp.down)):
            assert isinstance(lin, Linear)
            n, k = _linear_shape(lin)
            lin.impl, label = choose(configs, proj, n, k)
            used[label] = used.get(label, 0) + 1
    return used


def _linear_shape(lin) -> tuple[int, int]:
    buf = lin._buffers.get("weight")
    if buf is None:
        buf = lin._buffers["qweight"]
    return int(buf.shape[0]), int(buf.shape[1])


def prepare_engine(cfg: EngineConfig, model, enabled: bool = True) -> dict:
    """The engine's step: load the daemon's (or an earlier engine's) winners, or tune and save them,
    then apply them. A cache that cannot be written costs only the next start a re-tune."""
    if not enabled:
        log.info("[Autotuner]: disabled (--no-enable-autotune); every projection uses F.linear")
        log.info(TRIALS_LINE.format(trials=0))
        return {"enabled": False, "trials": 0}
    doc, path, trials = load_or_tune(cfg, "engine", save_errors_fatal=False)
    configs = doc["configs"]
    used = apply(model, configs)
    log.info("[Autotuner]: projections per implementation: %s", json.dumps(used, sort_keys=True))
    log.info(TRIALS_LINE.format(trials=trials))
    return {"enabled": True, "trials": trials, "path": str(path), "configs": len(configs), "used": used}
