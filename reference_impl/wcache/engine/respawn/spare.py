"""A ``wcache serve --respawn`` worker: a fresh interpreter that gets as far into an engine start as
it can without a KV cache, then waits until its supervisor (engine/respawn/respawn.py) promotes it to serve.

A hot spare: while it waits it holds its CUDA context, has the weights (zero_copy maps the daemon's
arena again, at no memory cost; disk reads its own copy) and has run a warm-up forward
(runner.warm_up), so kernels and libraries are loaded. What that costs on the device, the spare
reserve, is measured here and counted by the serving worker's memory plan (memory.MemoryPlan).
Promotion then only sizes and allocates the KV cache (runner.finish) and starts answering.
``ipc_cache`` copy mode cannot do this: the serving worker had the daemon release the weights, so
the spare waits cold (imports only) and loads after promotion, as it says in its log.

Started as ``python -m wcache.engine.respawn.spare`` with its settings as JSON in ``WCACHE_SPARE_SPEC``:
``wcache serve``'s settings (api_server/settings.py's ServeSettings, checked again here), and three
inherited descriptors: the listening socket, a control pipe it reads its promotion from and a status
pipe it writes its progress to (one JSON object a line, no pickle). Once promoted it runs ``wcache serve``'s own start-up (engine.run_serve) with
the inherited socket: the same loaders, memory plan and autotune as a plain ``wcache serve``.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import sys
import threading
import time

T0 = time.monotonic()

import torch  # noqa: E402  (the point of a spare: this import happens before it is needed)

from wcache import logs  # noqa: E402
from wcache.core import no_dump  # noqa: E402
from wcache.engine.serve import run_serve  # noqa: E402
from wcache.engine.loading import registry  # noqa: E402,F401  (every loader: disk, ipc_cache and their modules)
from wcache.engine.loading import waiting as cache_wait  # noqa: E402
from wcache.engine.loading.config import parse_loader_config  # noqa: E402
from wcache.engine.loading.lease import CacheLease  # noqa: E402,F401
from wcache.engine.respawn.handed import HandedConnections  # noqa: E402
from wcache.engine.respawn.heartbeat import Heartbeat  # noqa: E402
from wcache.engine.respawn.respawn import BEAT_S, SPARE_ENV  # noqa: E402
from wcache.core.process_memory import process_device_bytes  # noqa: E402
from wcache.engine.worker.memory import format_bytes  # noqa: E402
from wcache.engine.worker.runner import RankRunner, die_with_parent  # noqa: E402
from wcache.engine.api_server.served import ServedModel  # noqa: E402
from wcache.engine.api_server.settings import ServeSettings  # noqa: E402
from wcache.core.settings import from_data  # noqa: E402
from wcache.engine.api_server.server import EngineServer  # noqa: E402,F401
from wcache.engine.worker.supervisor import Supervisor  # noqa: E402,F401
from wcache.errors import UserError  # noqa: E402
from wcache.wire.transports import auto  # noqa: E402,F401
# The /metrics registry is built when the engine is ready (engine/api_server/metrics.py); importing its library
# then cost a promoted spare's first answer ~10 ms. The supervisor set PROMETHEUS_MULTIPROC_DIR in
# this process's environment at spawn, which is all prometheus_client reads at import.
import prometheus_client.core  # noqa: E402,F401
import prometheus_client.multiprocess  # noqa: E402,F401

log = logging.getLogger("wcache.engine")

SPARE_READY = ("Spare engine worker pid {pid} ready: torch and wcache imported in {seconds:.2f} s, "
               "no CUDA context (CUDA initialized: {cuda})")
SPARE_HOT = ("Hot spare engine worker pid {pid} ready in {seconds:.2f} s: weights from {source}, warm-up forward "
             "run, no KV cache; spare reserve {reserve} ({bytes} bytes) on {device}")
# The same preparation in a worker whose order was already waiting (not a spare: no "Hot spare" line).
PREPARED_AT_ONCE = ("Engine worker pid {pid} prepared in {seconds:.2f} s: weights from {source}, warm-up forward "
                    "run; spare reserve {reserve} ({bytes} bytes) on {device}")
SPARE_COLD_COPY = ("Spare engine worker pid {pid} waits cold: in copy mode the serving worker had the daemon release "
                   "the weights, so this spare loads them after its promotion")
NO_NVML = ("NVML cannot read the free device memory ({error}); the spare reserve counts the warm-up and weights "
           "but not the CUDA context")
RESERVE_PHASES = "Spare engine worker pid {pid} holds on the device after each phase (bytes): {phases}"
NO_PROCESS_MEMORY = ("NVML cannot tell the device memory of this process alone; the spare reserve is the device's free "
                     "memory before less after its preparation, which counts other processes' allocations meanwhile")
SPARE_COLD_FAILED = "Spare engine worker pid {pid} could not prepare ({error}); it loads after its promotion"
# A worker whose order was waiting when its imports were done (the first one, or one started when
# no spare was left) was never a spare: it says so.
PROMOTED_AT_ONCE = "Engine worker pid {pid}: torch and wcache imported in {seconds:.2f} s"


_STATUS_LOCK = threading.Lock()  # the heartbeat thread writes on the same pipe


def tell(status, **event) -> None:
    """One line to the supervisor (an empty one is a heartbeat); a supervisor that is gone takes
    us with it (PR_SET_PDEATHSIG)."""
    line = json.dumps(event) + "\n" if event else "\n"
    with _STATUS_LOCK:
        try:
            status.write(line)
            status.flush()
        except (BrokenPipeError, OSError):
            pass


def warm_up() -> None:
    """The first CPU operator call initializes torch's dispatcher and thread pool: pay it now."""
    with torch.inference_mode():
        (torch.ones(8, 8) @ torch.ones(8, 8)).sum().item()


def free_device_bytes(device: torch.device) -> int | None:
    """Free bytes on the device, read before this process creates a CUDA context where NVML can
    (so the context counts in the reserve); None on CPU. The fallback when NVML cannot tell what
    this one process holds (core/process_memory.py): other processes' allocations meanwhile count too."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else 0
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free)
    except Exception as e:  # no NVML: the context's own cost is then not in the reserve
        log.warning(NO_NVML.format(error=e))
        return int(torch.cuda.mem_get_info(device)[0])


class ReservePhases:
    """The device memory this spare holds after each phase of its preparation, as NVML counts it for
    this process alone (context, weights, warm-up, graphs): what the reserve is made of. Empty where
    NVML cannot tell, and on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.index = device.index if device.index is not None else 0
        self.held: dict[str, int] = {}

    def mark(self, phase: str) -> None:
        if self.device.type != "cuda":
            return
        torch.cuda.synchronize(self.device)
        held = process_device_bytes(index=self.index)
        if held is not None:
            self.held[phase] = held

    def context(self) -> None:
        """Create this process's CUDA context now, alone, so its own cost is a phase of its own."""
        if self.device.type == "cuda":
            torch.empty(1, device=self.device)
            self.mark("context")

    @property
    def total(self) -> int | None:
        """What it holds while it waits: the last phase's figure."""
        return list(self.held.values())[-1] if self.held else None


def prepare(settings: ServeSettings, at_once: bool):
    """(the prepared rank, its status fields) of a hot spare, or (None, fields) for a cold one."""
    from wcache.engine.core.engine import rank_specs

    loader_config = parse_loader_config(settings.core.model_loader_extra_config)
    if settings.engine.load_format == "ipc_cache" and loader_config.mode == "copy":
        log.info(SPARE_COLD_COPY.format(pid=os.getpid()))
        return None, {"warm": False, "cold": "copy mode"}
    t0 = time.monotonic()
    try:
        plan, specs = rank_specs(settings.engine, loader_config)
        runner = RankRunner.from_spec(specs[0])
        if len(specs) > 1 or not plan.drives or runner.world.size > 1:
            log.info(SPARE_COLD_FAILED.format(pid=os.getpid(), error="an engine of several ranks"))
            return None, {"warm": False, "cold": "several ranks"}
        before = free_device_bytes(runner.device)
        phases = ReservePhases(runner.device)
        phases.context()
        runner.prepare(phases.mark)
    except Exception as e:  # a daemon gone, a file unreadable: the promotion tries again, cold, and says why
        if at_once and isinstance(e, UserError):
            raise  # never a spare: this was its start, and a second try would repeat the error (and the wait)
        log.warning(SPARE_COLD_FAILED.format(pid=os.getpid(), error=str(e).splitlines()[0] if str(e) else repr(e)))
        return None, {"warm": False, "cold": "prepare failed"}
    if phases.total is not None:  # what this process holds, whatever the others did meanwhile
        runner.spare_reserve = phases.total
        log.info(RESERVE_PHASES.format(pid=os.getpid(), phases=json.dumps(phases.held)))
    elif before is not None:
        log.warning(NO_PROCESS_MEMORY)
        runner.spare_reserve = max(0, before - int(torch.cuda.mem_get_info(runner.device)[0]))
    else:  # CPU: a context is free; the budget is host memory, where a disk copy of the weights counts
        runner.spare_reserve = sum(ld.report.nbytes - ld.report.external_bytes for ld in runner.loads)
    fields = {"warm": True, "reserve_bytes": runner.spare_reserve, "reserve_phases": phases.held,
              "device": str(runner.device),
              "prepare_s": round(time.monotonic() - t0, 3), "kv_cache": runner.kv_cache is not None,
              "weights": runner.report.source}
    log.info((PREPARED_AT_ONCE if at_once else SPARE_HOT).format(
        pid=os.getpid(), seconds=time.monotonic() - t0, source=runner.report.source,
        reserve=format_bytes(runner.spare_reserve), bytes=runner.spare_reserve, device=runner.device))
    return runner, fields


def main() -> int:
    no_dump.forbid()  # the listening socket's hand-offs, then the weights: see core/no_dump.py
    spec = json.loads(os.environ.pop(SPARE_ENV))
    settings = from_data(ServeSettings, spec["settings"])  # checked again: another process, maybe another version
    logs.setup(settings.core.log_level)
    die_with_parent(spec["parent_pid"])
    warm_up()
    status = os.fdopen(spec["status_fd"], "w", buffering=1)
    control = os.fdopen(spec["control_fd"], "r")
    cuda = torch.cuda.is_initialized()  # False: is_initialized() itself creates nothing
    seconds = time.monotonic() - T0
    waiting = select.select([control], [], [], 0)[0]
    log.info((PROMOTED_AT_ONCE if waiting else SPARE_READY).format(pid=os.getpid(), seconds=seconds, cuda=cuda))
    # The supervisor answers /health until a worker is ready: it says "waiting" as this one's would.
    cache_wait.subscribe(lambda body: tell(status, event="waiting", health=body))
    try:
        runner, fields = prepare(settings, at_once=bool(waiting))
    except UserError as e:  # a configuration error: the promotion reports it as a plain start would
        if waiting:  # the first worker's own start failed: report it once, as a plain start does
            log.error("%s", e)
            return 2
        runner, fields = None, {"warm": False, "cold": "prepare failed"}
        log.warning(SPARE_COLD_FAILED.format(pid=os.getpid(), error=e))
    try:
        # Read and compiled while waiting, not after the promotion.
        served = ServedModel.from_settings(settings.model, settings.api)
    except UserError:
        served = None  # the promotion builds it again and stops with its error, as a plain start would
    tell(status, event="spare", pid=os.getpid(), import_s=round(seconds, 3), cuda_initialized=cuda, **fields)
    line = control.readline()  # blocks until promoted; EOF: the supervisor stops
    if not line:
        if runner is not None:
            runner.close()
        return 0
    promoted = time.monotonic()
    order = json.loads(line)
    channel = socket.socket(fileno=spec["handoff_fd"])
    # Connections come from the supervisor (engine/respawn/handed.py), never from a listening socket: the
    # server listens on a private loopback port that nobody is told, so its accept never fires.
    sock = socket.create_server(("127.0.0.1", 0))
    timeout = settings.respawn_heartbeat_timeout
    heartbeat = Heartbeat(lambda: tell(status), BEAT_S, stall_s=timeout / 2)

    def on_ready(engine, server) -> None:
        HandedConnections(channel, server).start()
        # Its stamps on CLOCK_MONOTONIC, which the supervisor's and a bench's share (respawn.TIMELINE).
        tell(status, event="ready", pid=os.getpid(),
             phases={"order_received": round(promoted, 6), "ready": round(time.monotonic(), 6)})
        heartbeat.watch(engine.runner)
        heartbeat.start()

    try:
        return run_serve(settings, parse_loader_config(settings.core.model_loader_extra_config), sock=sock,
                         answer_while_loading=order["answer_while_loading"], on_ready=on_ready,
                         prepared=runner, served=served)
    except UserError as e:
        log.error("%s", e)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
