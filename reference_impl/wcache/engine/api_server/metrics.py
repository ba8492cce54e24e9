"""The engine's ``GET /metrics``: vLLM's request metrics under vLLM's names and labels, and what no
engine exports: how this one got its weights, whether it fell back to disk, whether its daemon lives.

``EngineMetrics`` belongs to one ``EngineServer`` (a private registry each: tests run several in one
process). The HTTP side calls ``render_metrics() -> (body, content type)``; the routes call
``request()`` around each completion; ``run_serve`` calls ``engine_ready(engine)`` once the weights
are bound. Until then nothing imports prometheus_client (core/metrics.py says why); a scrape or a
request before that builds the metrics on the spot.

Under ``wcache serve --respawn`` the supervisor gives its workers one multiprocess directory
(engine/respawn/respawn.py): counters and histograms then sum every worker's, the dead included, and the
live gauges are the serving worker's.
"""

from __future__ import annotations

import contextlib
import threading
import time

from wcache.core import metrics as m
from wcache.core.background import Background
from wcache.core.metrics import Metric

MODEL = ("model_name", "engine")  # vLLM's labels; ``engine`` is vLLM's engine index, "0" here
# vLLM's buckets (vllm/v1/metrics/loggers.py), so that dashboards built for vLLM read ours.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason; "abort": the client went away

RUNNING = Metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", MODEL,
                 live=True)
WAITING = Metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", MODEL,
                 live=True)
PROMPT_TOKENS = Metric("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", MODEL)
GENERATION_TOKENS = Metric("vllm:generation_tokens", "counter", "Number of generation tokens processed.", MODEL)
SUCCESS = Metric("vllm:request_success", "counter", "Count of successfully processed requests.",
                 MODEL + ("finished_reason",))
TTFT = Metric("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.", MODEL,
              TTFT_BUCKETS)
E2E = Metric("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.", MODEL,
             E2E_BUCKETS)
READY = Metric("wcache_engine_ready", "gauge", "1 once the weights are bound and /health answers 200, 0 while they load.",
               ("model_name",), live=True)
WEIGHTS = Metric("wcache_engine_weights_info", "gauge",
                 "1, labelled with how this engine got its weights: the --load-format asked for, the source that "
                 "served them (disk or ipc_cache), the mode and the transport (none from disk).",
                 ("model_name", "load_format", "source", "mode", "transport"), live=True)
LOAD_SECONDS = Metric("wcache_engine_weights_load_seconds", "gauge",
                      "Seconds from the loader's call to bindable tensors (a fallback counts the failed attempt too).",
                      ("model_name",), live=True)
MAPPED_BYTES = Metric("wcache_engine_weights_mapped_bytes", "gauge",
                      "Bytes of weights this engine maps from the daemon's memory (zero_copy) instead of owning.",
                      ("model_name",), live=True)
FALLBACK = Metric("wcache_engine_weights_fallback", "gauge",
                  "1 while this engine serves weights it read from disk because the weight cache could not serve "
                  "them, labelled with the reason; absent otherwise.", ("model_name", "reason"), live=True)
DAEMON_ALIVE = Metric("wcache_engine_daemon_alive", "gauge",
                      "zero_copy only: 1 while the daemon whose memory this engine maps holds the lease, 0 once it "
                      "is gone (the engine keeps serving); absent for other loads.", ("model_name",), live=True)
LOADS = Metric("wcache_engine_weight_loads", "counter",
               "Weight loads by source (under --respawn, every worker's).", ("model_name", "source"))
FALLBACKS = Metric("wcache_engine_weight_fallbacks", "counter",
                   "Loads that fell back to disk, by reason (under --respawn, every worker's).", ("model_name", "reason"))

METRICS = [RUNNING, WAITING, PROMPT_TOKENS, GENERATION_TOKENS, SUCCESS, TTFT, E2E, READY, WEIGHTS, LOAD_SECONDS,
           MAPPED_BYTES, FALLBACK, DAEMON_ALIVE, LOADS, FALLBACKS]
NONE = "none"  # a label's value where the load had no mode or transport


def load_labels(report, load_format: str) -> dict:
    """How a LoadReport says the weights came: source, mode, transport (and the fallback's reason)."""
    cache = report.source.startswith("the weight cache")
    mode = report.source.split("(")[-1].rstrip(")") if cache else NONE
    return {"load_format": load_format, "source": "ipc_cache" if cache else "disk", "mode": mode,
            "transport": report.transport or NONE, "reason": report.fallback_kind}


class RequestTiming:
    """One completion, from its arrival (the body read) to its end."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics, self.start = metrics, time.monotonic()
        self.first: float | None = None

    def first_token(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def finish(self, completion, finish_reason: str | None = None) -> None:
        """Count a finished completion: its tokens, TTFT, latency and finish reason."""
        first = getattr(completion, "first_token_at", None) or self.first
        self.metrics._finished(completion, finish_reason or completion.finish_reason,
                               None if first is None else first - self.start, time.monotonic() - self.start)


class EngineMetrics:
    def __init__(self, server):
        self.server = server
        self.labels = (server.model_name, "0")
        self._lock = threading.Lock()
        self._built = False
        self.in_flight = 0  # completions between arrival and end (the serial engine's running + waiting)
        self._counted_load = False

    # -- building (once, on first need) ----------------------------------------------------
    def _build(self) -> None:
        with self._lock:
            if self._built:
                return
            directory = m.multiprocess_dir()
            self.registry = m.new_registry(directory)
            stored = None if directory else self.registry  # multiprocess: the directory's collector reads them
            self.stored = {x.name: m.build(x, stored) for x in METRICS if not x.live}
            # Each completion's series, looked up once (labels() takes a lock and a dict lookup).
            lab = self.labels
            self._per_request = (self.stored[PROMPT_TOKENS.name].labels(*lab),
                                 self.stored[GENERATION_TOKENS.name].labels(*lab),
                                 {r: self.stored[SUCCESS.name].labels(*lab, r) for r in FINISHED_REASONS},
                                 self.stored[TTFT.name].labels(*lab), self.stored[E2E.name].labels(*lab))
            self.registry.register(_Live(self))
            self._built = True

    def engine_ready(self, engine) -> None:
        """The weights are bound: count the load, and build the metrics off the serving path."""
        Background(self._count_load, engine)

    def _count_load(self, engine) -> None:
        self._build()
        with self._lock:
            if self._counted_load:
                return
            self._counted_load = True
        self._count(engine.report, engine.load_format)

    def core_promoted(self, report, load_format: str) -> None:
        """A --respawn spare engine core took over (front_failover.py): its own load is counted, as the
        one-process supervisor's workers each count theirs."""
        Background(self._count_again, report, load_format)

    def _count_again(self, report, load_format: str) -> None:
        self._build()
        self._count(report, load_format)

    def _count(self, report, load_format: str) -> None:
        labels = load_labels(report, load_format)
        self.stored[LOADS.name].labels(self.server.model_name, labels["source"]).inc()
        if labels["reason"]:
            self.stored[FALLBACKS.name].labels(self.server.model_name, labels["reason"]).inc()

    # -- what the routes call ----------------------------------------------------------------
    @contextlib.contextmanager
    def request(self):
        """Around one completion: counts it in flight; the route calls ``finish`` on the timing."""
        self._build()
        with self._lock:
            self.in_flight += 1
        try:
            yield RequestTiming(self)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _finished(self, completion, reason: str, ttft: float | None, e2e: float) -> None:
        prompt, generation, success, ttft_hist, e2e_hist = self._per_request
        prompt.inc(completion.prompt_tokens)
        generation.inc(len(completion.token_ids))
        success[reason if reason in FINISHED_REASONS else "stop"].inc()
        if ttft is not None:
            ttft_hist.observe(ttft)
        e2e_hist.observe(e2e)

    def render_metrics(self) -> tuple[bytes, str]:
        """(body, content type) of ``GET /metrics``, in Prometheus' text format."""
        self._build()
        return m.render(self.registry)

    # -- live values -------------------------------------------------------------------------
    def running_waiting(self) -> tuple[int, int]:
        """The engine's own counts where it has them (continuous batching), else today's serial
        engine's: one decodes, the others wait for its lock."""
        engine = self.server.engine if self.server.ready else None
        running = getattr(engine, "num_requests_running", None)
        waiting = getattr(engine, "num_requests_waiting", None)
        if callable(running) and callable(waiting):
            return int(running()), int(waiting())
        n = self.in_flight
        return min(n, 1), max(n - 1, 0)


class _Live:
    """The gauges read at scrape time (core/metrics.py: live)."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics

    def collect(self):
        em, server = self.metrics, self.metrics.server
        name, labels = server.model_name, em.labels
        ready = bool(server.ready and server.engine is not None)
        running, waiting = em.running_waiting()
        yield m.live_family(RUNNING, [(labels, running)])
        yield m.live_family(WAITING, [(labels, waiting)])
        yield m.live_family(READY, [((name,), 1.0 if ready else 0.0)])
        if not ready:
            return
        engine = server.engine
        how = load_labels(engine.report, engine.load_format)
        yield m.live_family(WEIGHTS, [((name, how["load_format"], how["source"], how["mode"], how["transport"]), 1.0)])
        yield m.live_family(LOAD_SECONDS, [((name,), engine.report.seconds)])
        yield m.live_family(MAPPED_BYTES, [((name,), engine.report.external_bytes)])
        yield m.live_family(FALLBACK, [((name, how["reason"]), 1.0)] if how["reason"] else [])
        alive = engine.daemon_alive()  # None: not a zero_copy load
        yield m.live_family(DAEMON_ALIVE, [((name,), alive)] if alive is not None else [])


def render_metrics(server) -> tuple[bytes, str]:
    """The front door's entry point: ``server.metrics.render_metrics()``."""
    return server.metrics.render_metrics()
