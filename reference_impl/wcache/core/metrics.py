"""Prometheus metrics, as both sides declare, build and render them (prometheus_client underneath).

A ``Metric`` is one declared series family: its name, kind, help, labels and (histograms) buckets.
engine/api_server/metrics.py and daemon/metrics.py each declare their list; the guide's metric table is
generated from those lists (tools/doc_tables.py), and a test scrapes both servers and compares.

Two ways a value reaches a scrape:

- **stored**: a counter, histogram or gauge that code updates as things happen. Where several
  processes add to one family (the daemon's ranks; ``wcache serve --respawn``'s workers) they use
  prometheus_client's multiprocess mode: each process writes its values to files in a directory
  (``PROMETHEUS_MULTIPROC_DIR``, which prometheus_client reads when it is first imported) and the
  process that answers ``/metrics`` sums the files. A dead process's counters stay in the sum, as
  counters should; its live gauges are dropped (``mark_dead``).
- **live**: a gauge read from state at scrape time (a ``Collector``), e.g. whether the engine is
  ready or how it got its weights. It is rendered by the answering process only.

prometheus_client is imported only inside functions: a daemon rank must set the directory before
the first import, and importing it costs an engine tens of milliseconds it should not pay before
its weights are bound.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable
KINDS = ("counter", "gauge", "histogram")


@dataclass(frozen=True)
class Metric:
    name: str  # a counter's without its ``_total``, as prometheus_client takes it
    kind: str  # counter, gauge or histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    live: bool = False  # read at scrape time by a collector, not stored
    gauge_mode: str = "livesum"  # how a stored gauge of several processes is combined

    @property
    def exposed(self) -> str:
        """The name a scrape shows (a counter's sample name ends in ``_total``)."""
        return self.name + "_total" if self.kind == "counter" else self.name


def build(metric: Metric, registry=None):
    """The prometheus_client object of a stored metric, registered in ``registry`` (None: in no
    registry; multiprocess mode, where the directory's collector reads it)."""
    import prometheus_client as pc

    # No ``*_created`` series: multiprocess mode has none, so a scrape shows the same families in
    # either mode (and half the series). A process-wide switch; wcache's processes have no other user.
    pc.disable_created_metrics()
    assert not metric.live and metric.kind in KINDS, metric
    kw = {"labelnames": metric.labels, "registry": registry}
    if metric.kind == "counter":
        return pc.Counter(metric.name, metric.help, **kw)
    if metric.kind == "histogram":
        return pc.Histogram(metric.name, metric.help, buckets=metric.buckets, **kw)
    return pc.Gauge(metric.name, metric.help, multiprocess_mode=metric.gauge_mode, **kw)


def live_family(metric: Metric, samples: list[tuple[tuple[str, ...], float]]):
    """A live gauge's family for a collector: one sample per (label values, value)."""
    from prometheus_client.core import GaugeMetricFamily

    assert metric.live and metric.kind == "gauge", metric
    family = GaugeMetricFamily(metric.name, metric.help, labels=metric.labels)
    for values, value in samples:
        family.add_metric(list(values), value)
    return family


def multiprocess_dir() -> str | None:
    """The directory of this process's stored values, when in multiprocess mode."""
    return os.environ.get(MULTIPROC_ENV) or None


def new_registry(directory: str | None = None):
    """A private registry (never prometheus_client's global one: two servers in one process, as in
    tests, must not share or collide). With ``directory``, it sums every process's stored values."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=True)
    if directory:
        from prometheus_client.multiprocess import MultiProcessCollector

        MultiProcessCollector(registry, path=directory)
    return registry


def render(registry) -> tuple[bytes, str]:
    """(body, content type) of a scrape: the text exposition format, by prometheus_client."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry), CONTENT_TYPE_LATEST


def make_dir(prefix: str) -> str:
    """A private, empty directory for the stored values of a group of processes."""
    return tempfile.mkdtemp(prefix=prefix)  # mode 0700


def mark_dead(pid: int, directory: str | None) -> None:
    """Drop a dead process's live gauges from the sum (its counters stay)."""
    if directory:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, directory)


def remove_dir(directory: str | None) -> None:
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def table(metrics: list[Metric]) -> list[tuple[str, str, str, str]]:
    """(exposed name, kind, labels, help) rows: what the guide's table shows."""
    return [(m.exposed, m.kind, ", ".join(m.labels), m.help) for m in metrics]
