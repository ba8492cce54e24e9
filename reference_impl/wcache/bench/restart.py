"""A daemon restart that adopts a running engine's arena, for `wcache bench`, split into phases.

The bench starts a daemon with no engine to take an arena from (the *first start*: it loads from
disk, on a warm page cache), lets a real `zero_copy` engine map its weights, SIGKILLs the daemon
(launcher and ranks) and times the next daemon from its spawn to the launcher's READY line. Both
starts are split into the phases the rank logs when it serves (daemon/rank.py ``START_PHASES``:
interpreter, imports, CUDA context, cache key, asking offers, importing the arena, verifying it,
loading from disk, autotune, the rest) plus ``launcher`` (the launcher's own start until it spawns
the rank) and ``ready_notice`` (the rank serving until the bench reads READY). Beside them the same
run measures a *floor*: a fresh ``python -c "import torch; torch.cuda.init()"`` (``import torch``
on the CPU), what any restarted daemon process pays before its own work.

In the same run, a *standby takeover*: with the restarted daemon serving the engine, a second
daemon is started with ``--weight-cache-standby`` (it imports and waits on the device's lock), the
serving daemon is SIGKILLed, and the standby is timed from the kill to its READY line. Its host
memory while it stands by (launcher and ranks, resident set) is recorded beside it, and the engine
must answer the same after the takeover as before it.

Only transports whose arena an engine can hand back are measured: a cuda_ipc daemon writes no
arena record and adopts nothing, so the phase is skipped with that reason, never waited for.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time

from wcache.bench.api import complete
from wcache.bench.failure import bench_failure, log_tail
from wcache.bench.processes import tree_rss_bytes
from wcache.bench.settings import BenchSettings
from wcache.daemon.rank import START_PHASES
from wcache.errors import ADOPTED, ARENA_RECORDED, LEASED_AGAIN, STANDING_BY, BenchError, LEASE_LOST

FLOOR = {"cuda": "import torch; torch.cuda.init()", "cpu": "import torch"}
PHASES = ("launcher", "interpreter", "imports", "spec_wait", "cuda_context", "key", "offers", "import_arena", "verify", "load",
          "autotune", "other", "ready_notice")
RECORD_WAIT_S = 300
OFFER_WAIT_S = 60
STANDBY_WAIT_S = 300  # its interpreters import torch before it says it stands by
_PHASES_LINE = re.compile(re.escape(START_PHASES).replace(r"\{rank\}", r"\d+").replace(r"\{phases\}", r"(\{.*\})"))


def floor_seconds(device: str, n: int) -> list[float]:
    """Spawn-to-exit of ``python -c FLOOR[device]``, n times, each a fresh process."""
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", FLOOR[device]], check=True, timeout=600)
        out.append(time.monotonic() - t0)
    return out


def start_phases(daemon, t0: float) -> dict:
    """The phases of one daemon start that the bench spawned at ``t0`` (monotonic): the rank's own,
    and around them the launcher's start and the time until READY was read. They add up to ready_s."""
    m = _PHASES_LINE.search(daemon.text())
    if not m:
        return {}
    rank = json.loads(m.group(1))
    out = {"launcher": rank["spawned_at"] - t0}
    out.update({k: rank[k] for k in PHASES if k in rank})
    out["ready_notice"] = daemon.ready_s - (rank["ready_at"] - t0)
    return {k: round(out.get(k, 0.0), 4) for k in PHASES}


def _timed_start(new_daemon):
    t0 = time.monotonic()
    daemon = new_daemon()
    return daemon, start_phases(daemon, t0)


def _fail(what: str, timeout: float, *procs) -> BenchError:
    """bench_failure for ``what`` that did not come, after logging the last lines of each process."""
    *others, (who, proc) = procs
    for other, p in others:
        log_tail(other, p.text())
    return bench_failure(what, who, proc.text(), waited_s=timeout)


def _wait_for(text, needle: str, timeout: float, what: str, *procs) -> None:
    deadline = time.monotonic() + timeout
    while needle not in text():
        if time.monotonic() > deadline:
            raise _fail(what, timeout, *procs)
        time.sleep(0.02)


def handback_restart(settings: BenchSettings, work, daemon, lc, new_daemon, kind: str) -> dict:
    """The first start and the adopting restart of one run, with their phases and the floor. Returns
    the result with the daemon left running under "daemon" (the caller stops it)."""
    from wcache.bench.start import EngineUnderTest
    from wcache.wire.arenas import HANDED_BACK_KINDS

    if kind not in HANDED_BACK_KINDS:
        return {"daemon": daemon, "skipped": f"a {kind} arena cannot be handed back (its handle dies with the "
                                              "daemon that exported it), so no restart adopts one"}
    floor = floor_seconds(settings.device, max(1, settings.repeat))
    daemon.stop()  # a first start of its own, timed phase by phase like the restart
    first, first_phases = _timed_start(new_daemon)
    try:
        eng = EngineUnderTest(settings, work, "ipc_cache", lc)
    except BaseException:
        first.stop()
        raise
    again = None
    try:
        # A GPU arena's record (its keyed hash) is written in the background after READY; a daemon
        # killed before that leaves nothing to adopt against, and the restart would time a disk load.
        recorded = ARENA_RECORDED.split(" {kind}")[0].replace("Rank {rank}", "")
        _wait_for(first.text, recorded, RECORD_WAIT_S, "the daemon's arena record", ("daemon", first))
        first.kill()
        first.stop()
        _wait_for(eng.text, LEASE_LOST.split(" {path}")[0], OFFER_WAIT_S, "the engine's hand-back offer",
                  ("engine", eng))
        again, phases = _timed_start(new_daemon)
        adopted = "adopted the arena of a running engine" in again.text()
        if not adopted:
            log_tail("restarted daemon (it did not adopt)", again.text())
        med_floor = statistics.median(floor)
        restart = {"transport": kind, "first_start_to_ready_s": round(first.ready_s, 4),
                   "restart_to_ready_s": round(again.ready_s, 4), "adopted": adopted,
                   "first_start_phases_s": first_phases, "restart_phases_s": phases,
                   "floor_command": FLOOR[settings.device], "floor_s": round(med_floor, 4),
                   "floor_samples": [round(f, 4) for f in floor],
                   "restart_over_first_start": round(again.ready_s / first.ready_s, 3),
                   "restart_minus_floor_s": round(again.ready_s - med_floor, 4)}
        again, standby = standby_takeover(again, eng, new_daemon, first.ready_s)  # the standby serves now
        return {"daemon": again, **restart, **standby}
    except BaseException:
        (again or first).stop()  # the caller stops only the daemon it is handed back
        raise
    finally:
        eng.stop()


def _answer(port: int) -> list:
    return json.loads(complete(port, "standby", 8, timeout=120)[1])["choices"]


def standby_takeover(active, eng, new_daemon, first_start_s: float):
    """Start a standby beside ``active`` (serving ``eng``), SIGKILL ``active`` and time the standby
    from the kill to READY. Returns (the standby, now serving, and the record's standby_* keys).
    ``standby_measurement_s`` is what this adds to the bench's run, the standby's imports included."""
    t_begin = time.monotonic()
    _wait_for(eng.text, LEASED_AGAIN.split(" {path}")[0], OFFER_WAIT_S, "the engine's lease on the restarted daemon",
              ("engine", eng))
    before = _answer(eng.port)
    standby = new_daemon(extra=("--weight-cache-standby",), log_name="standby.log", wait=False)
    try:
        _wait_for(standby.text, STANDING_BY.split(":")[0], STANDBY_WAIT_S, "the standby's standing-by line",
                  ("standby", standby))
        rss = tree_rss_bytes(standby.proc.pid) / 2**20  # MiB: what a standby costs the host
        t_kill = time.monotonic()
        active.kill()
        took = standby.wait_ready(t_kill)
        active.stop()
    except BaseException:
        standby.kill()
        standby.stop()
        raise
    m = _PHASES_LINE.search(standby.text())
    phases = {k: v for k, v in json.loads(m.group(1)).items() if k not in ("spawned_at", "ready_at")} if m else {}
    adopted = ADOPTED.split(" (pid")[0].replace("Rank {rank} ", "") in standby.text()
    if not adopted:
        log_tail("standby daemon (it did not adopt)", standby.text())
    # The engine re-leases from a standby that adopted its arena (else it keeps its own memory), and
    # answers as it did before the takeover.
    if adopted:
        leased = LEASED_AGAIN.split(" {path}")[0]
        _wait_for(lambda: "twice" if eng.text().count(leased) >= 2 else "", "twice", OFFER_WAIT_S,
                  "the engine's lease on the standby", ("engine", eng))
    answered = _answer(eng.port) == before
    return standby, {"standby_takeover_s": round(took, 4), "standby_phases_s": phases, "standby_adopted": adopted,
                     "standby_over_first_start": round(took / first_start_s, 3),
                     "standby_rss_mib": round(rss, 1), "standby_engine_answered_the_same": answered,
                     "standby_measurement_s": round(time.monotonic() - t_begin, 2)}


def render_lines(h: dict) -> list[str]:
    """The bench table's lines for the restart."""
    if not h:
        return []
    if h.get("skipped"):
        return [f"daemon restart with adoption: skipped: {h['skipped']}"]
    lines = [f"daemon restart to READY: {h['restart_to_ready_s']:.3f} s "
             f"({'adopted the running engine' + chr(39) + 's arena' if h['adopted'] else 'loaded from disk'}); "
             f"first start {h['first_start_to_ready_s']:.3f} s"]
    if "floor_s" in h:
        lines.append(f"floor (python -c \"{h['floor_command']}\"): {h['floor_s']:.3f} s; restart is floor + "
                     f"{h['restart_minus_floor_s']:.3f} s, {h['restart_over_first_start']:.0%} of the first start")
        for label, key in (("first start", "first_start_phases_s"), ("restart", "restart_phases_s")):
            lines.append(f"daemon {label} phases (s): " + ", ".join(f"{k} {v}" for k, v in h[key].items()))
    if "standby_takeover_s" in h:  # records before the standby lack it
        lines.append(f"standby takeover, SIGKILL of the serving daemon to the standby's READY: "
                     f"{h['standby_takeover_s']:.3f} s ({'adopted' if h['standby_adopted'] else 'loaded from disk'}), "
                     f"{h['standby_over_first_start']:.0%} of the first start; the standby held "
                     f"{h['standby_rss_mib']:.0f} MiB of host memory while it waited; the engine answered "
                     f"{'the same' if h['standby_engine_answered_the_same'] else 'DIFFERENTLY'} after it")
        lines.append("standby phases (s): " + ", ".join(f"{k} {v}" for k, v in h["standby_phases_s"].items()))
    return lines
