"""What one step of the engine loop costs and where its time goes, on the host and on the GPU.

A step is one turn of Engine._loop: scheduling, the joining prompts' passes, one decode pass,
sampling, and handing the tokens to the request threads. Per step the clock keeps:

* ``step_ms``: the engine thread's wall time, from asking the scheduler to the last token handed;
* ``gpu_ms``: the device's own time for the step's passes, from CUDA events recorded before each
  pass's first copy and after its last kernel (null on CPU, where a pass is host time);
* ``gpu_idle_ms``: the device idle between the end of one step's work and the start of the next's
  (only for a step that follows a busy one: an engine waiting for requests is not overhead), and
  ``gpu_idle_in_step_ms``, idle between the passes of one step (a prompt's sampling before the
  decode pass);
* ``host_ms``: the step's wall time less the time it blocked waiting for the device, and
  ``cpu_ms``, the engine thread's CPU time (``time.thread_time``): what is left of host_ms is time
  the thread was runnable but not running, which in one interpreter is mostly waiting for the GIL;
* ``rows``: sequences decoded, ``graph_rows``: rows the decode pass computed (a bucket of them,
  engine/worker/gpu_steps.py), ``prompts``: prompt passes;
* ``profile``: the host time by phase (scheduling, prompt passes, the decode pass, waiting for the
  device, sampling, handing tokens, the rest). On a GPU a pass's phase is its launch (staging the
  inputs, replaying a graph); on CPU it is the whole pass.

Figures are means per step over a *busy period*, the steps from an idle engine's first one to the
one after which nothing runs; the last ``PERIODS`` periods are kept (Engine.close logs them), and
the steps without a prompt pass are summed apart (``decode_steps``): they are the steady state.
Events cost a few microseconds of host time each; a step records two per pass.
"""

from __future__ import annotations

import collections
import time

import torch

PERIODS = 8  # busy periods kept for the log (the streaming bench reads the last two)
PHASES = ("schedule", "prompt_pass", "decode_pass", "gpu_wait", "sample", "hand")
NO_GPU = "a CPU engine: its passes run on the host, inside host_ms (profile: prompt_pass, decode_pass)"


class _Sums:
    """Per-step sums over some steps; ``summary`` gives their means."""

    FIELDS = ("step", "gpu", "gpu_idle", "gpu_idle_in_step", "host", "cpu", "rows", "graph_rows", "prompts")

    def __init__(self):
        self.steps = self.idle_steps = 0
        self.total = dict.fromkeys(self.FIELDS, 0.0)
        self.phases = dict.fromkeys(PHASES, 0.0)

    def add(self, step: dict, phases: dict, idle_counted: bool) -> None:
        self.steps += 1
        self.idle_steps += idle_counted
        for k in self.FIELDS:
            self.total[k] += step.get(k) or 0.0
        for k, v in phases.items():
            self.phases[k] += v

    def summary(self, gpu: bool) -> dict:
        n = max(self.steps, 1)
        t = self.total

        def ms(key: str, over: int = n):
            return round(1e3 * t[key] / max(over, 1), 4)

        out = {"steps": self.steps, "rows": round(t["rows"] / n, 2), "graph_rows": round(t["graph_rows"] / n, 2),
               "prompts": round(t["prompts"] / n, 2), "step_ms": ms("step"), "host_ms": ms("host"), "cpu_ms": ms("cpu"),
               "gpu_ms": ms("gpu") if gpu else None,
               "gpu_idle_ms": ms("gpu_idle", self.idle_steps) if gpu else None,
               "gpu_idle_in_step_ms": ms("gpu_idle_in_step") if gpu else None}
        profile = {f"{k}_ms": round(1e3 * v / n, 4) for k, v in self.phases.items()}
        profile["other_ms"] = round(out["host_ms"] - sum(profile.values()) + profile["gpu_wait_ms"], 4)
        out["profile"] = profile
        return out


class _Period:
    def __init__(self):
        self.all, self.decode = _Sums(), _Sums()

    def summary(self, gpu: bool) -> dict:
        return {**self.all.summary(gpu), "decode_steps": self.decode.summary(gpu)}


class StepClock:
    """The engine thread's clock: ``begin``, phases and device sections, ``end`` per step."""

    def __init__(self, device: torch.device):
        self.gpu = device.type == "cuda"
        self.device = device
        self.periods: collections.deque[_Period] = collections.deque(maxlen=PERIODS)
        self._period: _Period | None = None
        self._last_end = None  # the previous step's last device event, while the engine stays busy
        self._free_events: list = []

    # -- one step -----------------------------------------------------------------------------
    def begin(self) -> None:
        """Before asking the scheduler for the next step."""
        self._t0, self._c0 = time.perf_counter(), time.thread_time()
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._sections: list[tuple] = []
        self._open = None

    def scheduled(self, busy: bool) -> None:
        """The scheduler answered. ``busy``: the engine had sequences running before this step (an
        idle one's wait for requests is neither a step's time nor its scheduling)."""
        now = time.perf_counter()
        if busy:
            self._phases["schedule"] += now - self._t0
        else:
            self._t0, self._c0 = now, time.thread_time()
            self._last_end = None
        if self._period is None:
            self._period = _Period()
            self.periods.append(self._period)

    def add(self, phase: str, seconds: float) -> None:
        self._phases[phase] += seconds

    def device_begin(self) -> None:
        """Before a pass's first device work (its inputs' copy)."""
        if self.gpu:
            self._open = self._event()
            self._open.record(torch.cuda.current_stream(self.device))

    def device_end(self) -> float:
        """After a pass's last device work (the sampler's argmax): wait for it; the seconds waited."""
        if not self.gpu:
            return 0.0
        end = self._event()
        end.record(torch.cuda.current_stream(self.device))
        t = time.perf_counter()
        end.synchronize()
        waited = time.perf_counter() - t
        self._phases["gpu_wait"] += waited
        self._sections.append((self._open, end))
        return waited

    def end(self, rows: int, graph_rows: int, prompts: int, busy_after: bool) -> None:
        """The step is over. ``busy_after``: sequences still run, so the next step follows at once."""
        step = {"step": time.perf_counter() - self._t0, "cpu": time.thread_time() - self._c0,
                "rows": rows, "graph_rows": graph_rows, "prompts": prompts}
        step["host"] = step["step"] - self._phases["gpu_wait"]
        idle_counted = False
        if self._sections:
            busy = sum(a.elapsed_time(b) for a, b in self._sections) / 1e3
            span = self._sections[0][0].elapsed_time(self._sections[-1][1]) / 1e3
            step["gpu"], step["gpu_idle_in_step"] = busy, max(span - busy, 0.0)
            if self._last_end is not None:
                step["gpu_idle"] = self._last_end.elapsed_time(self._sections[0][0]) / 1e3
                idle_counted = True
                self._free_events.append(self._last_end)
            # Every event is done (device_end waited): all go back but the last, which the next step
            # measures its idle from.
            self._free_events += [e for pair in self._sections for e in pair][:-1]
            self._last_end = self._sections[-1][1]
        if not busy_after and self._last_end is not None:
            self._free_events.append(self._last_end)
            self._last_end = None
        period = self._period
        period.all.add(step, self._phases, idle_counted)
        if not prompts:
            period.decode.add(step, self._phases, idle_counted)
        if not busy_after:
            self._period = None

    def _event(self):
        return self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)

    # -- the log --------------------------------------------------------------------------------
    def as_json(self) -> dict:
        """The kept busy periods, oldest first, and why the GPU fields are null where they are."""
        out = {"busy_periods": [p.summary(self.gpu) for p in self.periods]}
        if not self.gpu:
            out["gpu_null_because"] = NO_GPU
        return out
