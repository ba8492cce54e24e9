"""`wcache bench`: time "weights ready" for disk, zero_copy and copy in one run (handoff.py), plus the
key's cost, an engine's whole start to /health 200 (start.py), and a daemon restart that adopts a
running engine's arena (restart.py); one record of them all, and its table.

Every sample runs in a fresh process, beside a real `wcache preload` daemon with a private socket
directory (processes.py). The engine start is a real `wcache serve` process timed from its spawn to
the first /health 200, its own start-up split into ``ENGINE_PHASES``. Ratios come from figures
measured in this one run.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path

from wcache.bench.handoff import sample_in_fresh_process
from wcache.bench.host import environment
from wcache.bench.processes import DaemonUnderTest
from wcache.bench.settings import BenchSettings
from wcache.core.config import EngineConfig
from wcache.core.fingerprint import RACY_WINDOW_NS, checkpoint_digest
from wcache.engine.loading.config import LoaderConfig
from wcache.wire.sockets import short_private_dir


def warm_page_cache(model: str) -> None:
    """Read every shard once, so the disk samples start from a warm page cache. Read as bytes, not
    loaded: a load onto the GPU left this process's allocator holding the weights' memory for the
    whole bench (22.64 GiB of an 80 GB H100 at f4ffa20, where the ipc_cache engine then ran out)."""
    for shard in sorted(Path(model).glob("*.safetensors")):
        with open(shard, "rb") as f:
            while f.read(64 << 20):
                pass


def run_bench(settings: BenchSettings) -> int:
    # Short whatever TMPDIR is: the daemon's socket (named after its device) goes in it. Removed at
    # the end, logs included (a failure prints their last lines itself, failure.py).
    work = short_private_dir("wcache-bench-")
    try:
        return _run_bench(settings, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_bench(settings: BenchSettings, work: Path) -> int:
    cfg = EngineConfig.build(settings.model, settings.dtype, settings.quantization, settings.device)
    env = environment(cfg.device)
    n = max(1, settings.repeat)
    sockets = work / "s"
    sockets.mkdir(mode=0o700)
    os.environ["WCACHE_CACHE_ROOT"] = str(work / "cache")  # a cold fingerprint memo for this run
    # The children's temporary files too (a daemon killed with SIGKILL leaves its metrics directory):
    # removed with the rest at the end, not left in the caller's TMPDIR.
    os.environ["TMPDIR"] = str(work)

    # The checkpoint key: first sight of this path hashes every byte; a restart reuses the memo.
    t0 = time.perf_counter()
    _, first_stats = checkpoint_digest(cfg.model)
    key_first = time.perf_counter() - t0
    if first_stats["files_unsettled"]:
        # Files written moments ago are not remembered (coarse timestamps could hide a change);
        # an engine restarting later sees them settled, so measure the restart in that state.
        time.sleep(RACY_WINDOW_NS / 1e9)
        checkpoint_digest(cfg.model)
    t0 = time.perf_counter()
    checkpoint_digest(cfg.model)
    key_cached = time.perf_counter() - t0

    warm_page_cache(cfg.model)  # the baseline is a warm-cache disk load
    disk = [sample_in_fresh_process(settings, "safetensors")["seconds"] for _ in range(n)]

    zero_copy, copy, phases, copy_phases = [], [], [], []
    lc_zero = LoaderConfig(mode="zero_copy", fallback=True, socket_dir=str(sockets))
    lc_copy = LoaderConfig(mode="copy", fallback=True, socket_dir=str(sockets))
    daemon = DaemonUnderTest(cfg.model, cfg.device, settings.dtype, sockets, settings.transport,
                                     quantization=settings.quantization)
    try:
        for _ in range(n):
            r = sample_in_fresh_process(settings, "ipc_cache", lc_zero)
            zero_copy.append(r["seconds"])
            phases.append(r["phases"])
            tensors, tensors_kind = r["tensors"], r["transport"]
        for i in range(n):
            # Copy mode releases the daemon's weights, so each sample gets a fresh daemon.
            if i:
                daemon.stop()
                daemon = DaemonUnderTest(cfg.model, cfg.device, settings.dtype, sockets, settings.transport,
                                     quantization=settings.quantization)
            r = sample_in_fresh_process(settings, "ipc_cache", lc_copy)
            copy.append(r["seconds"])
            copy_phases.append(r["phases"])
            nbytes = r["nbytes"]
        # The restart a user lives through: engine process start to /health 200, disk and cache.
        daemon.stop()
        daemon = DaemonUnderTest(cfg.model, cfg.device, settings.dtype, sockets, settings.transport,
                                     quantization=settings.quantization)
        from wcache.bench.restart import handback_restart
        from wcache.bench.start import engine_starts

        engine_start = engine_starts(settings, work, lc_zero, n)
        handback = handback_restart(settings, work, daemon, lc_zero, lambda **kw: DaemonUnderTest(
            cfg.model, cfg.device, settings.dtype, sockets, settings.transport, quantization=settings.quantization,
            **kw),
            tensors_kind)
        daemon = handback.pop("daemon")
    finally:
        daemon.stop()

    med = {k: statistics.median(v) for k, v in
           {"disk": disk, "zero_copy": zero_copy, "copy": copy}.items()}
    result = {
        "environment": env,
        "transport": tensors_kind,
        "model": {"path": cfg.model, "tensors": tensors, "bytes": nbytes, "dtype": cfg.dtype_name,
                  "quantization": cfg.quant.config()},
        "repeat": n,
        "sampling": "each sample in a fresh process (page cache warm, process new)",
        "seconds": {**{k: round(v, 6) for k, v in med.items()},
                    "key_first_sight": round(key_first, 6), "key_restart": round(key_cached, 6)},
        "samples": {"disk": disk, "zero_copy": zero_copy, "copy": copy},
        "zero_copy_phases_ms": {k: round(1e3 * statistics.median(p[k] for p in phases), 3) for k in phases[0]},
        "copy_phases_ms": {k: round(1e3 * statistics.median(p[k] for p in copy_phases), 3) for k in copy_phases[0]},
        "engine_start": engine_start,
        "handback": handback,
        "ratios": {
            "disk_over_zero_copy": round(med["disk"] / med["zero_copy"], 2),
            "disk_over_copy": round(med["disk"] / med["copy"], 2),
            "key_restart_over_disk": round(key_cached / med["disk"], 4),
            "key_first_sight_over_disk": round(key_first / med["disk"], 4),
        },
        "copy_effective_gb_per_s": round(nbytes / med["copy"] / 1e9, 2),
        "key_first_sight_bytes_hashed": first_stats["bytes_hashed"],
    }
    text = json.dumps(result, indent=2)
    if settings.output:
        Path(settings.output).write_text(text + "\n")
    if settings.json:
        print(text)
    else:
        print(render_table(result))
    return 0


def render_table(r: dict) -> str:
    s, ratios, env = r["seconds"], r["ratios"], r["environment"]
    lines = [
        f"wcache bench: {r['model']['tensors']} tensors, {r['model']['bytes'] / 2**20:.1f} MiB, "
        f"device {env['device']}, torch {env['torch']}, {env['date']}, median of {r['repeat']}",
        f"transport: {r['transport']}",
        f"{'source':<26}{'weights ready (s)':>20}{'vs disk':>10}",
        f"{'disk (warm page cache)':<26}{s['disk']:>20.4f}{'1.0x':>10}",
        f"{'ipc_cache zero_copy':<26}{s['zero_copy']:>20.4f}{ratios['disk_over_zero_copy']:>9}x",
        f"{'ipc_cache copy':<26}{s['copy']:>20.4f}{ratios['disk_over_copy']:>9}x",
        "zero_copy steps (ms): " + ", ".join(f"{k} {v}" for k, v in r["zero_copy_phases_ms"].items()),
        f"cache key: first sight {s['key_first_sight']:.4f} s ({ratios['key_first_sight_over_disk']:.1%} of disk), "
        f"restart {s['key_restart']:.4f} s ({ratios['key_restart_over_disk']:.2%} of disk)",
    ]
    if "copy_phases_ms" in r:
        lines.append("copy steps (ms): " + ", ".join(f"{k} {v}" for k, v in r["copy_phases_ms"].items()))
    e = r.get("engine_start")
    if e:
        lines.append(f"engine start to /health 200: disk {e['disk']['seconds']:.3f} s, ipc_cache "
                     f"{e['ipc_cache']['seconds']:.3f} s ({e['disk_over_ipc_cache']}x)")
        if "floor" in e:
            lines.append(f"start floor (interpreter, import torch, CUDA context): {e['floor']['seconds']:.3f} s; "
                         f"ipc_cache start is {e['ipc_cache_over_floor_s']:.3f} s above it")
        for fmt in [f for f in ("disk", "ipc_cache", "floor") if f in e]:
            lines.append(f"{fmt} start phases (s): " + ", ".join(f"{k} {v}" for k, v in e[fmt]["phases_s"].items()))
    from wcache.bench.restart import render_lines

    lines += render_lines(r.get("handback"))
    return "\n".join(lines)
