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

from wcache.daemon.rank import START_PHASES
from wcache.bench_failure import bench_failure, log_tail
from wcache.errors import ARENA_RECORDED, BenchError, LEASE_LOST

FLOOR = {"cuda": "import torch; torch.cuda.init()", "cpu": "import torch"}
PHASES = ("launcher", "interpreter", "imports", "spec_wait", "cuda_context", "key", "offers", "import_arena", "verify", "load",
          "autotune", "other", "ready_notice")
RECORD_WAIT_S = 300
OFFER_WAIT_S = 60
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


def handback_restart(args, work, daemon, lc, new_daemon, kind: str) -> dict:
    """The first start and the adopting restart of one run, with their phases and the floor. Returns
    the result with the daemon left running under "daemon" (the caller stops it)."""
    from wcache.bench_start import EngineUnderTest
    from wcache.wire.arenas import HANDED_BACK_KINDS

    if kind not in HANDED_BACK_KINDS:
        return {"daemon": daemon, "skipped": f"a {kind} arena cannot be handed back (its handle dies with the "
                                              "daemon that exported it), so no restart adopts one"}
    floor = floor_seconds(args.device, max(1, args.repeat))
    daemon.stop()  # a first start of its own, timed phase by phase like the restart
    first, first_phases = _timed_start(new_daemon)
    try:
        eng = EngineUnderTest(args, work, "ipc_cache", lc)
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
        return {"daemon": again, "transport": kind, "first_start_to_ready_s": round(first.ready_s, 4),
                "restart_to_ready_s": round(again.ready_s, 4), "adopted": adopted,
                "first_start_phases_s": first_phases, "restart_phases_s": phases,
                "floor_command": FLOOR[args.device], "floor_s": round(med_floor, 4),
                "floor_samples": [round(f, 4) for f in floor],
                "restart_over_first_start": round(again.ready_s / first.ready_s, 3),
                "restart_minus_floor_s": round(again.ready_s - med_floor, 4)}
    except BaseException:
        (again or first).stop()  # the caller stops only the daemon it is handed back
        raise
    finally:
        eng.stop()


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
    return lines
