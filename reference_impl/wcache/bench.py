"""`wcache bench`: time "weights ready" for disk, zero_copy and copy in one run, plus the key's cost,
an engine's whole start to /health 200, and a daemon restart that adopts a running engine's arena.

"Weights ready" is what an engine restart waits for before it can bind its model: for disk, read
the shards and post-process; for the cache, compute the key, ask the daemon and bind views (copy
mode also clones). Every sample runs in a fresh process, beside a real `wcache preload` daemon with
a private socket directory. The engine start is a real `wcache serve` process timed from its spawn
to the first /health 200, its own start-up split into ``ENGINE_PHASES`` (bench_start.py). Ratios
come from figures measured in this one run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from wcache import __version__
from wcache.core.config import EngineConfig
from wcache.engine.loading.registry import load_weights
from wcache.core.fingerprint import RACY_WINDOW_NS, checkpoint_digest
from wcache.engine.loading.config import LoaderConfig
from wcache.daemon.launcher import READY
from wcache.bench_failure import bench_failure
from wcache.wire.sockets import short_private_dir


START_TIMEOUT_S = 1800  # a daemon loading a large checkpoint from a cold disk
SETTLE_S = 2.0  # after a disk engine stops, before the next timed start


def environment(device: str) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
           "wcache": __version__, "device": device, "cpu_count": os.cpu_count()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            env["driver"] = "unknown"
        env["cuda"] = torch.version.cuda
    commit = os.environ.get("WCACHE_COMMIT") or _git_commit()
    if commit:
        env["commit"] = commit  # the code the record measured (the guide labels records with it)
    return env


def _git_commit() -> str | None:
    """The checkout's short commit, where the package runs from one (a copied tree has none)."""
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_load(cfg, load_format, lc=None) -> tuple[float, object]:
    _sync(cfg.device)
    t0 = time.perf_counter()
    loaded = load_weights(cfg, load_format, lc)
    _sync(cfg.device)
    elapsed = time.perf_counter() - t0
    if loaded.report.fallback_reason:
        raise RuntimeError(f"bench expected the weight cache but the loader fell back: {loaded.report.fallback_reason}")
    return elapsed, loaded


def _warm_device(cfg) -> None:
    """A restarted engine creates its CUDA context whatever the weights' source: keep that out of
    every sample alike."""
    if cfg.device == "cuda":
        from wcache.wire.transports.cuda_ipc import cudart

        torch.empty(1, device=cfg.torch_device)
        cudart()


def sample_in_fresh_process(args, load_format: str, lc: LoaderConfig | None = None) -> dict:
    """One timed load in a new interpreter, as an engine restart does it: the page cache is warm,
    but the process (its allocator, its mappings) is new. Timing starts inside, after imports."""
    spec = {"model": args.model, "dtype": args.dtype, "device": args.device, "load_format": load_format,
            "loader": asdict(lc) if lc else None}
    out = subprocess.run([sys.executable, "-m", "wcache.bench", json.dumps(spec)], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise bench_failure(f"a {load_format} sample", "sample", out.stderr, code=out.returncode)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _sample_main(spec: dict) -> None:
    from wcache.core import disk
    from wcache.engine.loading import ipc_cache  # noqa: F401  (imports are process start-up, outside every sample)

    cfg = EngineConfig.build(spec["model"], spec["dtype"], None, spec["device"])
    _warm_device(cfg)
    lc = LoaderConfig(**spec["loader"]) if spec["loader"] else None
    elapsed, (_weights, report, _lease) = _timed_load(cfg, spec["load_format"], lc)
    print(json.dumps({"seconds": elapsed, "phases": report.phases, "tensors": report.tensors,
                      "nbytes": report.nbytes, "transport": report.transport}))


class DaemonUnderTest:
    """A real `wcache preload` in a private socket directory, for the length of a measurement."""

    def __init__(self, model: str, device: str, dtype: str, socket_dir: Path, transport: str = "auto",
                 extra: tuple[str, ...] = (), log_name: str = "daemon.log", wait: bool = True):
        """Started, and unless ``wait`` is False (a standby: bench_restart.py) READY."""
        self.socket_dir = socket_dir
        cmd = [sys.executable, "-m", "wcache.cli", "--log-level", "INFO", "preload", "--model", model,
               "--device", device, "--dtype", dtype, "--weight-cache-socket-dir", str(socket_dir),
               "--weight-cache-transport", transport, *extra]
        self.log_path = socket_dir.parent / log_name
        self.start = len(self.log_path.read_bytes()) if self.log_path.exists() else 0
        self.log = open(self.log_path, "ab")
        t0 = time.monotonic()
        # Its own session: a restart measurement kills the launcher and its ranks together.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.ready_s = self.wait_ready(t0)

    def wait_ready(self, since: float) -> float:
        """Seconds from ``since`` (monotonic) until this daemon logs READY."""
        deadline = time.monotonic() + START_TIMEOUT_S
        # Ready is the launcher's READY line: a killed daemon's socket file (and an engine's
        # hand-back offer) can lie in the directory before this daemon has bound anything.
        while READY not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                waited = START_TIMEOUT_S if self.proc.poll() is None else None
                waited and self.kill()
                raise bench_failure("the weight cache daemon's start", "daemon", self.text(),
                                    code=self.proc.returncode, waited_s=waited)
            time.sleep(0.01)
        return time.monotonic() - since

    def text(self) -> str:
        """What this daemon logged (the log file is shared by every daemon of the run)."""
        return self.log_path.read_bytes()[self.start:].decode(errors="replace")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        self.log.close()


def run_bench(args) -> int:
    # Short whatever TMPDIR is: the daemon's socket (named after its device) goes in it. Removed at
    # the end, logs included (a failure prints their last lines itself, bench_failure.py).
    work = short_private_dir("wcache-bench-")
    try:
        return _run_bench(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_bench(args, work: Path) -> int:
    cfg = EngineConfig.build(args.model, args.dtype, None, args.device)
    env = environment(cfg.device)
    n = max(1, args.repeat)
    sockets = work / "s"
    sockets.mkdir(mode=0o700)
    os.environ["WCACHE_CACHE_ROOT"] = str(work / "cache")  # a cold fingerprint memo for this run

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

    load_weights(cfg, "safetensors")  # warm the page cache: the baseline is a warm-cache disk load
    disk = [sample_in_fresh_process(args, "safetensors")["seconds"] for _ in range(n)]

    zero_copy, copy, phases, copy_phases = [], [], [], []
    lc_zero = LoaderConfig(mode="zero_copy", fallback=True, socket_dir=str(sockets))
    lc_copy = LoaderConfig(mode="copy", fallback=True, socket_dir=str(sockets))
    daemon = DaemonUnderTest(cfg.model, cfg.device, args.dtype, sockets, args.transport)
    try:
        for _ in range(n):
            r = sample_in_fresh_process(args, "ipc_cache", lc_zero)
            zero_copy.append(r["seconds"])
            phases.append(r["phases"])
            tensors, tensors_kind = r["tensors"], r["transport"]
        for i in range(n):
            # Copy mode releases the daemon's weights, so each sample gets a fresh daemon.
            if i:
                daemon.stop()
                daemon = DaemonUnderTest(cfg.model, cfg.device, args.dtype, sockets, args.transport)
            r = sample_in_fresh_process(args, "ipc_cache", lc_copy)
            copy.append(r["seconds"])
            copy_phases.append(r["phases"])
            nbytes = r["nbytes"]
        # The restart a user lives through: engine process start to /health 200, disk and cache.
        daemon.stop()
        daemon = DaemonUnderTest(cfg.model, cfg.device, args.dtype, sockets, args.transport)
        from wcache.bench_restart import handback_restart
        from wcache.bench_start import engine_start, start_floor

        engine_start(args, work, "ipc_cache", lc_zero)  # not kept: the first start of the run
        starts = {"disk": [], "ipc_cache": []}
        floor = []
        for _ in range(n):
            # The floor and the cache start side by side on a quiet host; the disk start last, then a
            # pause: the driver frees a disk engine's weights after its process has gone, and a start
            # meanwhile would pay for that.
            floor.append(start_floor(args))
            starts["ipc_cache"].append(engine_start(args, work, "ipc_cache", lc_zero))
            starts["disk"].append(engine_start(args, work, "safetensors"))
            time.sleep(SETTLE_S)
        starts["floor"] = floor
        handback = handback_restart(args, work, daemon, lc_zero, lambda **kw: DaemonUnderTest(
            cfg.model, cfg.device, args.dtype, sockets, args.transport, **kw), tensors_kind)
        daemon = handback.pop("daemon")
    finally:
        daemon.stop()

    med = {k: statistics.median(v) for k, v in
           {"disk": disk, "zero_copy": zero_copy, "copy": copy}.items()}
    result = {
        "environment": env,
        "transport": tensors_kind,
        "model": {"path": cfg.model, "tensors": tensors, "bytes": nbytes, "dtype": cfg.dtype_name},
        "repeat": n,
        "sampling": "each sample in a fresh process (page cache warm, process new)",
        "seconds": {**{k: round(v, 6) for k, v in med.items()},
                    "key_first_sight": round(key_first, 6), "key_restart": round(key_cached, 6)},
        "samples": {"disk": disk, "zero_copy": zero_copy, "copy": copy},
        "zero_copy_phases_ms": {k: round(1e3 * statistics.median(p[k] for p in phases), 3) for k in phases[0]},
        "copy_phases_ms": {k: round(1e3 * statistics.median(p[k] for p in copy_phases), 3) for k in copy_phases[0]},
        "engine_start": _engine_start_summary(starts),
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
    if args.output:
        Path(args.output).write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print(render_table(result))
    return 0


def _engine_start_summary(starts: dict) -> dict:
    """Per load format (and the floor), the median engine start (to /health 200; the lower middle
    one for an even count) and that start's phases, so the phases add up to the total shown beside
    them (medians taken phase by phase would not)."""
    out = {}
    for fmt, samples in starts.items():
        median = sorted(samples, key=lambda s: s["seconds"])[(len(samples) - 1) // 2]
        out[fmt] = {"seconds": round(median["seconds"], 4),
                    "samples": [round(s["seconds"], 4) for s in samples],
                    "phases_s": {k: round(v, 4) for k, v in median["phases"].items()}}
    out["disk_over_ipc_cache"] = round(out["disk"]["seconds"] / out["ipc_cache"]["seconds"], 2)
    # What the project can still shorten: the start via the cache beyond a bare interpreter that
    # imports torch and makes its CUDA context, measured in the same run.
    out["ipc_cache_over_floor_s"] = round(out["ipc_cache"]["seconds"] - out["floor"]["seconds"], 4)
    return out


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
    from wcache.bench_restart import render_lines

    lines += render_lines(r.get("handback"))
    return "\n".join(lines)


if __name__ == "__main__":  # one sample, for sample_in_fresh_process
    _sample_main(json.loads(sys.argv[1]))
