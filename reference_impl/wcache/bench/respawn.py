"""`wcache bench --respawn`: what a killed engine costs its clients under `wcache serve --respawn`,
against a restart from disk, measured in one run.

A real daemon (`wcache preload`) and a real `wcache serve --respawn --load-format ipc_cache` run
with a private socket directory. A steady client posts one completion after another, each on a
fresh connection; the serving worker is killed with SIGKILL while it does. Per kill the record
holds: the time from the kill to the first 200 answering a request sent after it ("death to next
200"; a request that waited in the backlog across the kill is answered sooner, by one request's
time, so this errs long), the supervisor's own death-to-ready, how long one answer took before the
kill (what the first answer after it costs in any case), and every failed request with its
kind (``refused`` must never happen; ``closed`` is the request in flight at the kill). Then, in the
same run: a fresh `wcache serve` from disk, and one with ``ipc_cache`` (a shell loop's restart),
each from its spawn to its first 200, and the spare's resident memory (the price of the mode).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
from dataclasses import replace
from pathlib import Path

from wcache.bench.api import complete, free_port
from wcache.bench.failure import bench_failure
from wcache.bench.processes import quantization_flag, rss_bytes, terminate
from wcache.bench.settings import BenchSettings
from wcache.engine.respawn.respawn import STABLE_S, TIMELINE
from wcache.engine.respawn.spare import SPARE_COLD_COPY, SPARE_COLD_FAILED, SPARE_HOT
from wcache.wire.sockets import short_private_dir

PROMPT, MAX_TOKENS = "Hello", 1  # the smallest answer: what a client waits for is the engine, not decoding
_READY = re.compile(r"Engine ready \(pid (\d+)\)")
# A spare that waits: hot (prepared, with its reserve) or cold (it says why).
_SPARE = re.compile("|".join(
    re.escape(before) + r"(\d+)" + re.escape(after.split("{")[0].split(":")[0])
    for before, after in (m.split("{pid}") for m in (SPARE_HOT, SPARE_COLD_COPY, SPARE_COLD_FAILED))))
_RESERVE = re.compile(re.escape(SPARE_HOT.split("{pid}")[0]) + r"\d+ .*?\((\d+) bytes\)")
_RESPAWNED = re.compile(r"Respawned: engine worker pid (\d+) ready ([\d.]+) s after worker pid (\d+) died \(([^)]*)\)")
_TIMELINE = re.compile(re.escape(TIMELINE.split("{")[0]) + r"(\{.*\})")
# The kill to the next 200, in phases that add up to it: each is the time between two stamps on
# CLOCK_MONOTONIC, which the bench, the supervisor and the worker share (respawn.TIMELINE).
PHASES = {
    "death_seen": "the kill to the supervisor reaping the worker's exit",
    "promote": "the supervisor's decision to its promotion order, written to the spare's pipe",
    "order_delivery": "the order on the pipe to the spare reading it",
    "worker_start": "the promoted spare's start: a hot spare sizes and allocates its KV cache (its context, "
                    "weights and warm-up are done while it waits), then its server is ready",
    "first_answer": "the worker ready to the first 200 of a request sent after the kill (the steady client "
                    "first gets the answer to its request in flight at the kill, handed again to this worker)",
}


def phases(killed: float, timeline: dict, next_200_at: float) -> dict:
    """PHASES for one kill, in seconds; their sum is ``next_200_at - killed`` by construction."""
    stamps = [killed, timeline["death_seen"], timeline["promoted"], timeline["worker"]["order_received"],
              timeline["worker"]["ready"], next_200_at]
    return {name: round(b - a, 6) for name, a, b in zip(PHASES, stamps, stamps[1:])}


def post(port: int, timeout: float = 60.0) -> int:
    """One completion on a fresh connection: the HTTP status."""
    try:
        return complete(port, PROMPT, MAX_TOKENS, timeout)[0]
    except urllib.error.HTTPError as e:
        return e.code


def failure_kind(e: BaseException) -> str:
    """``refused`` (nobody listened: what --respawn must prevent), ``closed`` (the connection died
    under the request), ``timeout``, or the exception's name."""
    e = getattr(e, "reason", e)
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                      http.client.IncompleteRead)):
        return "closed"
    if isinstance(e, TimeoutError):
        return "timeout"
    return type(e).__name__


class SteadyClient(threading.Thread):
    """Posts completions back to back until stopped; each result is (sent, answered, status or kind)."""

    def __init__(self, port: int):
        super().__init__(daemon=True, name="steady-client")
        self.port = port
        self.results: list[tuple[float, float, int | str]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            sent = time.monotonic()
            try:
                outcome: int | str = post(self.port)
            except Exception as e:  # noqa: BLE001  (every failure is recorded by kind)
                outcome = failure_kind(e)
            self.results.append((sent, time.monotonic(), outcome))

    def stop(self) -> list[tuple[float, float, int | str]]:
        self.done.set()
        self.join(120)
        return self.results


def kill_under_load(port: int, victim: int, settle_s: float = 0.5, after_s: float = 1.0, timeout: float = 120,
                    log_text=lambda: "") -> dict:
    """SIGKILL ``victim`` while a steady client runs; what the client saw. ``log_text``: the serving
    process's log so far, shown if the client never gets a first answer."""
    client = SteadyClient(port)
    client.start()
    deadline = time.monotonic() + timeout
    while not any(r[2] == 200 for r in client.results):
        if time.monotonic() > deadline:
            client.stop()
            raise bench_failure("the steady client's first answer", "wcache serve", log_text(), waited_s=timeout)
        time.sleep(0.01)
    time.sleep(settle_s)
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    while not any(r[0] >= killed and r[2] == 200 for r in client.results) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(after_s)
    results = client.stop()
    answered = [r[1] for r in results if r[0] >= killed and r[2] == 200]
    # The request in flight at the kill, answered by the next worker: the first answer after the kill.
    in_flight = [r[1] for r in results if r[0] < killed <= r[1] and r[2] == 200]
    failed = [{"kind": r[2], "sent_before_kill": r[0] < killed} for r in results if r[2] != 200]
    before = [r[1] - r[0] for r in results if r[1] < killed and r[2] == 200]
    return {"killed_at": killed, "next_200_at": min(answered) if answered else None,
            "death_to_next_200_s": round(min(answered) - killed, 4) if answered else None,
            "answer_before_kill_s": round(statistics.median(before), 4),
            "in_flight_answered_s": round(min(in_flight) - killed, 4) if in_flight else None,
            "requests": len(results), "failed": failed,
            "refused": sum(f["kind"] == "refused" for f in failed)}


class Serving:
    """A `wcache serve` process (with or without --respawn) and its log."""

    def __init__(self, settings: BenchSettings, work: Path, load_format: str, lc: dict | None, respawn: bool):
        self.port = free_port()
        self.log_path = work / f"serve-{self.port}.log"
        argv = [sys.executable, "-m", "wcache.cli", "--log-level", "INFO", "serve", settings.model,
                "--device", settings.device, "--dtype", settings.dtype, "--host", "127.0.0.1", "--port", str(self.port),
                "--load-format", load_format,
                "--shutdown-delay", "0", *quantization_flag(settings.quantization)]
        if lc is not None:
            argv += ["--model-loader-extra-config", json.dumps(lc)]
        if respawn:
            argv.append("--respawn")
        self.log = open(self.log_path, "wb")
        self.t0 = time.monotonic()
        # One process, asked for explicitly (two are the default): this bench times the older supervisor's
        # hot spare worker and reads its log lines (engine/respawn/spare.py); the front's failover is not measured here.
        env = {**os.environ, "WCACHE_ENABLE_V1_MULTIPROCESSING": "0"}
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, what: str, predicate, timeout: float = 1800) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                raise bench_failure(what, "wcache serve", self.text(), code=code,
                                    waited_s=None if code is not None else timeout)
            time.sleep(0.01)

    def first_200(self) -> float:
        """Seconds from spawn to the first completion answered 200 (polled every 10 ms)."""
        def answered() -> bool:
            try:
                return post(self.port, timeout=30) == 200
            except OSError:
                return False

        self.wait_for("a fresh wcache serve's first answer", answered)
        return time.monotonic() - self.t0

    def stop(self) -> int:
        code = terminate(self.proc, session=True)
        self.log.close()
        return code


def _pids(pattern: re.Pattern, text: str) -> list[int]:
    return [int(next(g for g in m.groups() if g is not None)) for m in pattern.finditer(text)]


def respawn_samples(settings: BenchSettings, work: Path, lc: dict, n: int) -> dict:
    """``n`` kills of the serving worker under a steady client, and the spare's memory."""
    s = Serving(settings, work, "ipc_cache", lc, respawn=True)
    try:
        kills, memory = [], {}
        for i in range(n):
            # The serving worker is ready and a spare waits.
            s.wait_for("the serving worker and its spare", lambda: len(_pids(_READY, s.text())) >= i + 1
                       and len(_pids(_SPARE, s.text())) >= i + 1)
            text = s.text()
            victim, spare = _pids(_READY, text)[-1], _pids(_SPARE, text)[-1]
            if not memory:
                memory = {"spare_rss_bytes": rss_bytes(spare), "serving_rss_bytes": rss_bytes(victim),
                          "supervisor_rss_bytes": rss_bytes(s.proc.pid),
                          # What the hot spare holds on the device, as it measured it (None: it waits cold).
                          "spare_reserve_bytes": next((int(m.group(1)) for m in _RESERVE.finditer(text)), None)}
            if i:
                time.sleep(STABLE_S)  # a kill sooner after the last would count as a crash loop and back off
            sample = kill_under_load(s.port, victim, log_text=s.text)
            s.wait_for("the respawn log line", lambda: len(_RESPAWNED.findall(s.text())) >= i + 1)
            m = list(_RESPAWNED.finditer(s.text()))[i]
            s.wait_for("the respawn's timeline", lambda: len(_TIMELINE.findall(s.text())) >= i + 1)
            timeline = json.loads(list(_TIMELINE.finditer(s.text()))[i].group(1))
            killed, next_200 = sample.pop("killed_at"), sample.pop("next_200_at")
            sample.update(worker_death_to_ready_s=float(m.group(2)), cause=m.group(4),
                          phases_s=phases(killed, timeline, next_200),
                          # Of death_seen: the kill to the worker's status pipe closing (the kernel at
                          # its descriptors); the rest of its exit is still to come before the reap.
                          exit_seen_s=round(timeline["exit_seen"] - killed, 6))
            kills.append(sample)
    finally:
        code = s.stop()
    if code != 0:
        raise bench_failure("wcache serve --respawn's stop", "wcache serve", s.text(), code=code)
    return {"kills": kills, "memory": memory}


def fresh_starts(settings: BenchSettings, work: Path, lc: dict | None, n: int) -> list[float]:
    """A fresh `wcache serve`, from its spawn to its first 200, ``n`` times: mapping the cache
    (``lc``, the daemon running) or from disk (None)."""
    out = []
    for _ in range(n):
        s = Serving(settings, work, "ipc_cache" if lc else "safetensors", lc, respawn=False)
        try:
            out.append(round(s.first_200(), 4))
        finally:
            s.stop()
    return out


def run_bench_respawn(settings: BenchSettings) -> int:
    work = short_private_dir("wcache-respawn-")  # short whatever TMPDIR is: a socket path fits
    try:
        return _run_bench_respawn(settings, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # as `wcache bench` does: nothing left in /tmp


def _run_bench_respawn(settings: BenchSettings, work: Path) -> int:
    from wcache.bench.host import environment
    from wcache.bench.processes import DaemonUnderTest
    from wcache.core.config import EngineConfig

    cfg = EngineConfig.build(settings.model, settings.dtype, settings.quantization, settings.device)
    settings = replace(settings, device=cfg.device)  # what auto picked, for every engine of the run
    n = max(1, settings.repeat)
    sockets = work / "s"
    sockets.mkdir(mode=0o700)
    os.environ["WCACHE_CACHE_ROOT"] = str(work / "cache")
    os.environ["TMPDIR"] = str(work)  # the children's temporary files (metrics of killed processes) go with it
    lc = {"socket_dir": str(sockets), "fallback": False}
    daemon = DaemonUnderTest(cfg.model, cfg.device, settings.dtype, sockets, settings.transport,
                             quantization=settings.quantization)
    try:
        respawn = respawn_samples(settings, work, lc, n)
        starts = {"ipc_cache": fresh_starts(settings, work, lc, n)}
    finally:
        daemon.stop()
    # A restart from disk is an engine without a weight cache: on a device that also held the
    # daemon's copy, its KV cache would not fit (an H100's 80 GB at 14e8735: out of memory).
    starts = {"safetensors": fresh_starts(settings, work, None, n), **starts}
    kills = respawn["kills"]
    # The phases of the median kill (medians of each phase would not add up to anything).
    median_kill = sorted(kills, key=lambda k: k["death_to_next_200_s"])[(len(kills) - 1) // 2]
    med = {
        "death_to_next_200": statistics.median(k["death_to_next_200_s"] for k in kills),
        "worker_death_to_ready": statistics.median(k["worker_death_to_ready_s"] for k in kills),
        "answer_before_kill": statistics.median(k["answer_before_kill_s"] for k in kills),
        "exit_seen": statistics.median(k["exit_seen_s"] for k in kills),
        "restart_from_disk": statistics.median(starts["safetensors"]),
        "restart_ipc_cache": statistics.median(starts["ipc_cache"]),
    }
    result = {
        "respawn": {"kills": kills, "memory": respawn["memory"]},
        "environment": environment(cfg.device),
        "model": {"path": cfg.model, "name": Path(cfg.model).name, "dtype": cfg.dtype_name},
        "transport": settings.transport if cfg.device == "cuda" else "memfd",
        "repeat": n,
        "phases": PHASES,
        "median_kill_phases_s": median_kill["phases_s"],
        "client": f"one steady client, POST /v1/completions max_tokens {MAX_TOKENS}, a fresh connection each",
        "restart_samples_s": starts,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "ratios": {"restart_from_disk_over_respawn": round(med["restart_from_disk"] / med["death_to_next_200"], 2),
                   "restart_ipc_cache_over_respawn": round(med["restart_ipc_cache"] / med["death_to_next_200"], 2)},
        "in_flight_answered": {"kills": sum(k["in_flight_answered_s"] is not None for k in kills),
                               "median_s": round(statistics.median(v), 4) if (v := [
                                   k["in_flight_answered_s"] for k in kills if k["in_flight_answered_s"] is not None])
                               else None},
        "failed_requests": sum(len(k["failed"]) for k in kills),
        "refused_connections": sum(k["refused"] for k in kills),
    }
    text = json.dumps(result, indent=2)
    if settings.output:
        Path(settings.output).write_text(text + "\n")
    print(text if settings.json else render_table(result))
    return 0


def render_table(r: dict) -> str:
    m, mem = r["median_s"], r["respawn"]["memory"]
    return "\n".join([
        f"wcache bench --respawn: {r['model']['name']}, device {r['environment']['device']}, "
        f"transport {r['transport']}, median of {r['repeat']}",
        f"worker killed (SIGKILL) to next 200: {m['death_to_next_200']:.3f} s "
        f"(supervisor: death to ready {m['worker_death_to_ready']:.3f} s; one answer before the kill "
        f"{m['answer_before_kill']:.3f} s)",
        "  the median kill, phase by phase: " + " + ".join(
            f"{name.replace('_', ' ')} {r['median_kill_phases_s'][name] * 1e3:.1f} ms" for name in r["phases"])
        + f" = {sum(r['median_kill_phases_s'].values()) * 1e3:.1f} ms",
        f"  of death seen, the kill to the worker's status pipe closing: {m['exit_seen'] * 1e3:.1f} ms (median)",
        "the request in flight at the kill, handed again to the next worker: " + (
            f"answered {f['median_s'] * 1e3:.1f} ms after the kill (median; in flight at {f['kills']} of "
            f"{r['repeat']} kills)" if (f := r["in_flight_answered"])["kills"] else "none was in flight at a kill"),
        f"fresh wcache serve to first 200: from disk {m['restart_from_disk']:.2f} s "
        f"({r['ratios']['restart_from_disk_over_respawn']:.1f}x), ipc_cache {m['restart_ipc_cache']:.2f} s "
        f"({r['ratios']['restart_ipc_cache_over_respawn']:.1f}x)",
        f"requests failed across the kills: {r['failed_requests']}, refused: {r['refused_connections']}",
        f"spare worker resident memory: {mem['spare_rss_bytes'] / 2**20:.0f} MiB "
        f"(serving worker {mem['serving_rss_bytes'] / 2**20:.0f} MiB, supervisor {mem['supervisor_rss_bytes'] / 2**20:.0f} MiB)",
        "spare reserve (counted in the serving worker's memory plan): " + (
            "none, the spare waits cold" if mem.get("spare_reserve_bytes") is None
            else f"{mem['spare_reserve_bytes'] / 2**20:.2f} MiB on {r['environment']['device']}"),
    ])
