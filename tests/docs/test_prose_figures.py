"""Every figure in the guide's prose has a source, and a measured one is checked against its record.

A figure here is a number with a unit (ms, s, MiB, GiB, GB, TB/s, tokens/s, %) or a ratio (x3.65,
"3.5 times"), found in a page's prose: outside its fenced blocks (run or validated by
tests/docs/test_blocks.py), its generated regions (rendered from the records by tools/doc_tables.py
and checked by tests/docs/test_tables.py), its HTML comments and its inline code. Each one a page
shows must be listed below for that page, with where it comes from:

* ``Record(file, fn)``: measured; ``fn(record)`` renders it from the JSON (or log) under
  docs/benchmarks/, and must give exactly the page's text;
* ``Code(fn)``: a constant or target the code defines; ``fn()`` renders it;
* ``Shown(page, pattern)``: what a block of a page prints, a block the docs tests run;
* ``Stated(why)``: not a measurement: a setting or limit the page tells the reader to use, a
  hardware fact, or another project's figure cited with its source;

So a figure typed into a page, or one changed by hand (x32.07 to x52.07), is a figure with no
source and fails here, and a record that changes fails the figure that quotes it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BENCH = DOCS / "benchmarks"
sys.path.insert(0, str(ROOT / "tools"))
import bench_records  # noqa: E402
import bench_tables  # noqa: E402

FIGURE = re.compile(
    r"(?<![\w.\-/`])(?:x\d+(?:\.\d+)?(?:-x\d+(?:\.\d+)?)?(?!\w)(?!\.\d)"
    r"|\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?"
    r"(?: ?(?:ms|µs|s|KiB|MiB|GiB|GB|MB|TB/s|tokens/s|%)(?![\w/])|x(?![\w.])| times\b))")


def prose(text: str) -> str:
    """The page without its fenced blocks, generated regions, HTML comments and inline code."""
    text = re.sub(r"(?s)<!-- generated: [^>]*-->.*?<!-- end generated -->", "", text)
    text = re.sub(r"(?ms)^(```+|~~~+).*?^\1\s*$", "", text)
    text = re.sub(r"(?s)<!--.*?-->", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def figures(page: str) -> set[str]:
    return set(FIGURE.findall(prose((DOCS / page).read_text(encoding="utf-8"))))


@dataclass(frozen=True)
class Record:
    file: str
    render: object  # (record dict, or the log's text) -> str

    def value(self) -> str:
        text = (BENCH / self.file).read_text(encoding="utf-8")
        return self.render(json.loads(text) if self.file.endswith(".json") else text)


@dataclass(frozen=True)
class Code:
    render: object  # () -> str

    def value(self) -> str:
        return self.render()


@dataclass(frozen=True)
class Shown:
    page: str
    pattern: str  # one group: the figure, in an output block of the page

    def value(self) -> str:
        blocks = re.findall(r"(?ms)^```(?:text|log)\n(.*?)^```", (DOCS / self.page).read_text(encoding="utf-8"))
        found = {m for b in blocks for m in re.findall(self.pattern, b)}
        assert len(found) == 1, (self.page, self.pattern, found)
        return found.pop()


@dataclass(frozen=True)
class Stated:
    why: str


# -- renderers ----------------------------------------------------------------------------------------
def ms(seconds: float) -> str:
    return f"{seconds * 1000:g} ms"


def same(*shown: str) -> str:
    """One figure that stands for several sources: they must agree."""
    assert len(set(shown)) == 1, shown
    return shown[0]


def target(model: str, what: str) -> float:
    [goal] = [g for _, m, w, g, _ in bench_tables.TARGETS if (m, w) == (model, what)]
    return goal


def streaming(commit: str) -> dict:
    [d] = [json.loads(p.read_text()) for p in BENCH.glob("*-http-streaming-*.json")
           if json.loads(p.read_text()).get("commit") == commit]
    return d


@cache
def fresh_switch_interval() -> float:
    """Python's own thread switch interval, in an interpreter that imported nothing of wcache."""
    out = subprocess.run([sys.executable, "-c", "import sys; print(sys.getswitchinterval())"],
                         capture_output=True, text=True, check=True)
    return float(out.stdout)


def gib(n_bytes: float, digits: int = 1) -> str:
    return f"{n_bytes / 2**30:.{digits}f} GiB"


DAEMON_MEMORY = "deploy/2026-12-04-h200-daemon-memory-vmm_fd.json"
RESPAWN_H200 = "2026-12-03-h200-llama-8b-respawn.json"  # the kubernetes page's memory row
LLAMA_8B = "2026-12-04-h200-llama-8b-vmm_fd.json"
SMALL = "2026-12-02-h200-small-cuda_ipc.json"


def _mem(d: dict, key: str) -> int:
    return d["respawn"]["memory"][key]


def _daemon_peak(d: dict) -> str:  # what cannot be reclaimed: anonymous and shared memory at the load's peak
    p = d["load_peaks_mib"]
    return gib((p["RssAnon"] + p["RssShmem"]) * 2**20)


def _respawn_total(d: dict) -> str:  # the engine under --respawn: serving worker, spare, supervisor
    m = d["respawn"]["memory"]
    return gib(m["serving_rss_bytes"] + m["spare_rss_bytes"] + m["supervisor_rss_bytes"])


ATTACK_ROUND = "what the outside attack round at f4ffa20 measured, as issue [sec-3] reports it; the attack is a test now"
SETTINGS = "a setting, limit or timeout the page tells the reader to use or the code applies, not a measurement"


def _frame_limit() -> str:
    from wcache.wire import protocol

    return f"{protocol.MAX_FRAME_BYTES >> 20} MiB"


def _core_frame_limit() -> str:
    from wcache.engine.core import core_messages

    return f"{core_messages.MAX_FRAME_BYTES >> 20} MiB"


def _arrival_wait() -> str:
    from wcache.engine.core.scheduler import ARRIVAL_WAIT_S

    return ms(ARRIVAL_WAIT_S)


def _fresh_connection() -> str:
    from wcache.engine.api_server.http_front import FRESH_S

    return ms(FRESH_S)


def _switch_interval() -> str:
    from wcache.engine.api_server.http_front import SWITCH_INTERVAL_S

    return ms(SWITCH_INTERVAL_S)


def _stable() -> str:
    from wcache.engine.respawn.respawn import STABLE_S

    return f"{STABLE_S:g} s"


def _beat() -> str:
    from wcache.engine.respawn.respawn import BEAT_S

    return f"{BEAT_S:g} s"


def _heartbeat_timeout() -> str:
    from wcache.engine.respawn.respawn import HEARTBEAT_TIMEOUT_S

    return f"{HEARTBEAT_TIMEOUT_S:g} s"


def _probes() -> str:
    from wcache.bench.health import PROBES

    return f"{PROBES} times"


def _tiny_size() -> str:
    return Shown("benchmarks.md", r"wcache bench: \d+ tensors, ([\d.]+ MiB)").value()


# -- each page's figures and their sources --------------------------------------------------------------
PAGES: dict[str, dict[str, object]] = {
    "benchmarks.md": {
        "3 ms": Code(lambda: ms(target("llama-8b", "zero_copy"))),
        "300 times": Code(lambda: f"{target('llama-8b', 'speedup'):g} times"),
        "20 ms": Code(lambda: same(ms(target("tensors-10k", "zero_copy")), _arrival_wait())),
        "1.2 TB/s": Code(lambda: f"{target('llama-8b', 'copy_tb_s'):g} TB/s"),
        "0.25 s": Code(lambda: f"{target('llama-8b', 'start_over_floor'):g} s"),
        "3.5 times": Code(lambda: f"{target('llama-8b', 'start_ratio'):g} times"),
        "1.8 MiB": Code(_tiny_size),
        "15 GiB": Record(LLAMA_8B, lambda d: f"{d['model']['bytes'] / 2**30:.0f} GiB"),
        # The streaming and respawn targets of the wave (CPU: tokens/s x6, first token p99 x4; H200:
        # decode x30, one client 120 tokens/s; respawn: 1.0 s, 7 times, 50 ms on the CPU).
        "6 times": Stated("a target the project set for the streaming bench (wave 4)"),
        "4 times": Stated("a target the project set for the streaming bench (wave 4)"),
        "30 times": Stated("a target the project set for the streaming bench (wave 4)"),
        "x6": Stated("a target the project set for the streaming bench (wave 4)"),
        "x30": Stated("a target the project set for the streaming bench (wave 4)"),
        "120 tokens/s": Stated("a target the project set for the streaming bench (wave 4)"),
        "1.0 s": Stated("a target the project set for the respawn bench"),
        "7 times": Stated("a target the project set for the respawn bench"),
        "50 ms": Stated("a target the project set for the respawn bench"),
        "80 GB": Stated("the H100's memory, a hardware fact"),
        "x5.62": Record("2026-12-06-cpu-http-streaming-tiny.json", lambda d: f"x{d['vs_one']['ttft_p99']}"),
        "x3.65": Record("2026-12-06-cpu-http-streaming-tiny-337d619.json", lambda d: f"x{d['vs_one']['ttft_p99']}"),
        "x8.96": Record("2026-12-06-cpu-http-streaming-tiny-337d619.json",
                        lambda d: f"x{d['vs_one']['tokens_per_s']}"),
        "x32.07": Record("2026-12-06-h100-http-streaming-llama-8b.json",
                         lambda d: f"x{d['vs_one']['decode_tokens_per_s']}"),
        "94 tokens/s": Record("2026-12-06-h100-http-streaming-llama-8b.json",
                              lambda d: f"{d['one_client']['decode_tokens_per_s']:.0f} tokens/s"),
        "3,027 tokens/s": Record("2026-12-06-h100-http-streaming-llama-8b.json",
                                 lambda d: f"{d['decode_tokens_per_s']:,.0f} tokens/s"),
        "x28": Record("2026-12-06-h100-http-streaming-llama-8b.json", lambda d: f"x{d['vs_one']['ttft_p99']:.0f}"),
        "35.9 ms": Record("2026-12-05-xeon-tiny-respawn.json",
                          lambda d: f"{d['median_s']['death_to_next_200'] * 1000:.1f} ms"),
        "51.0 ms": Record("2026-12-05-cpu-tiny-respawn.json",
                          lambda d: f"{d['median_s']['death_to_next_200'] * 1000:.1f} ms"),
        "10 s": Code(_stable),
        "200 times": Code(_probes),
        "1 ms": Code(_switch_interval),
        "5 ms": Code(lambda: ms(fresh_switch_interval())),
    },
    "serve-reference.md": {
        "20 ms": Code(lambda: same(_fresh_connection(), _arrival_wait())),
        "16 MiB": Code(_core_frame_limit),
        **{f: Stated(SETTINGS) for f in ("5 s", "512 MiB")},
        "17.7 s": Stated(ATTACK_ROUND),
    },
    "respawn.md": {
        "10 s": Code(_stable),  # and the kubelet's crash back-off, which starts at 10 s too
        "0.5 s": Stated(SETTINGS + ": the crash loop's back-off"),
        "1 s": Stated(SETTINGS + ": the crash loop's back-off"),
        "2 s": Stated(SETTINGS + ": the crash loop's back-off"),
        "8 s": Stated(SETTINGS + ": the crash loop's back-off"),
        "0.1 s": Code(_beat),
        "5 s": Code(_heartbeat_timeout),
        "3 s": Stated(SETTINGS + ": the pod spec's liveness probe"),
        "8 MiB": Stated(SETTINGS + ": the status pipe's frame limit"),
        "60 MiB": Stated("the bound tests/integration/test_respawn.py holds the supervisor to"),
        "0.26 s": Stated("vLLM's figure, cited with its source in the table"),
        "1.04 s": Stated("NVIDIA Dynamo's figure, cited with its source in the table"),
        "3.8 s": Stated("NVIDIA Dynamo's figure, cited with its source in the table"),
    },
    "kubernetes.md": {
        **{f: Stated(SETTINGS) for f in ("5 s", "30 s", "35 s", "10 s", "60 s", "64 MiB", "1 GiB", "8 GiB",
                                         "4 GiB", "900 s", "300 s")},
        "16 GB": Record(DAEMON_MEMORY, lambda d: f"{d['model']['bytes'] / 1e9:.0f} GB"),
        "2668 MiB": Record(DAEMON_MEMORY, lambda d: f"{d['rss_mib']:.0f} MiB"),
        "1349 MiB": Record(DAEMON_MEMORY, lambda d: f"{d['load_peaks_mib']['RssAnon']:.0f} MiB"),
        "2.5 GiB": Record(DAEMON_MEMORY, _daemon_peak),
        "1.10 GiB": Record(RESPAWN_H200, lambda d: bench_records.fmt_bytes(_mem(d, "serving_rss_bytes"))),
        "1.1 GiB": Record(RESPAWN_H200, lambda d: gib(_mem(d, "serving_rss_bytes"))),
        "501 MiB": Record(RESPAWN_H200, lambda d: bench_records.fmt_bytes(_mem(d, "spare_rss_bytes"))),
        "515 MiB": Record(RESPAWN_H200, lambda d: bench_records.fmt_bytes(_mem(d, "supervisor_rss_bytes"))),
        "0.5 GiB": Record(RESPAWN_H200, lambda d: gib(_mem(d, "spare_rss_bytes"))),
        "2.1 GiB": Record(RESPAWN_H200, _respawn_total),
    },
    "docker.md": {
        **{f: Stated(SETTINGS) for f in ("300 s", "5 s", "30 s", "10 s", "4 GiB")},
        "2.5 GiB": Record(DAEMON_MEMORY, _daemon_peak),
        "1.1 GiB": Record(RESPAWN_H200, lambda d: gib(_mem(d, "serving_rss_bytes"))),
    },
    "validation.md": {
        **{f: Stated(SETTINGS) for f in ("300 s", "900 s")},
        "80 GB": Stated("the H100's memory, a hardware fact"),
        "469 MiB": Record(SMALL, lambda d: bench_records.fmt_bytes(d["model"]["bytes"])),
        "600 s": Stated("the device tool's limit per call, a setting"),
    },
    "gpu-ci.md": {
        "80 GB": Stated("an H100's memory, a hardware fact"),
        "469 MiB": Record(SMALL, lambda d: bench_records.fmt_bytes(d["model"]["bytes"])),
    },
    "gpu-transports.md": {"14.96 GiB": Record(LLAMA_8B, lambda d: bench_records.fmt_bytes(d["model"]["bytes"]))},
    "security.md": {
        "15 GiB": Record(LLAMA_8B, lambda d: f"{d['model']['bytes'] / 2**30:.0f} GiB"),
        "16 MiB": Code(_frame_limit),
        **{f: Stated(SETTINGS + " (tests/docs/test_facts.py checks the daemon's bounds)")
           for f in ("64 MiB", "128 KiB", "128 MiB")},
        "512 MiB": Stated(SETTINGS),
    },
    "how-it-works.md": {"16 MiB": Code(_frame_limit)},
    "differences-from-vllm.md": {"16 MiB": Code(_frame_limit)},
    "quickstart.md": {"1.8 MiB": Code(_tiny_size)},
    "memory.md": {
        "1.01 MiB": Shown("memory.md", r"Weights are held outside this process: ([\d.]+ MiB) by the weight cache daemon; "
                                       r"budget 0\.5 x 8\.00 MiB = 4\.00 MiB = own weights 0 B \+ external weights 1\.0"),
        "1.75 MiB": Shown("memory.md", r"Weights are held outside this process: ([\d.]+ MiB) by the weight cache daemon; "
                                       r"budget 0\.5 x 8\.00 MiB = 4\.00 MiB = own weights 0 B \+ external weights 1\.7"),
        **{f: Stated(SETTINGS + ", or the arithmetic of a worked example")
           for f in ("1 KiB", "128 MiB", "128 KiB", "64 GiB", "16 GB", "8 MiB", "10%", "2 MiB")},
    },
    "lifecycle.md": {f: Stated(SETTINGS) for f in ("16 MiB", "64 MiB", "512 MiB", "0.3 s")},
    "faults.md": {**{f: Stated(SETTINGS) for f in ("64 KiB", "0.2 s", "60 s", "50 ms", "1 s", "10 s", "16 MiB",
                                                   "128 MiB", "5 s", "30 s", "512 MiB")},
                  **{f: Stated(ATTACK_ROUND) for f in ("1 GB", "10x", "40 s")}},
    "seeding-replicas.md": {f: Stated(SETTINGS) for f in ("1 MiB", "10 s", "2 s", "30 s", "64 MiB")},
    "troubleshooting.md": {f: Stated(SETTINGS) for f in ("100 MB", "512 MiB")},
    "autotune.md": {f: Stated(SETTINGS) for f in ("5%", "60 s", "64 KiB", "0.2 s", "10 s")},
    "contributing.md": {f: Stated(SETTINGS) for f in ("10 s", "300 s")},
    "monitoring.md": {"2 s": Stated("an example alert's threshold, which the page says to set from your model")},
    # Every phase's figure is another project's, cited with its link in the row (checked by
    # tests/docs/test_guide_agrees.py::test_what_a_restart_still_costs_sources_every_figure).
    "restart-costs.md": {f: Stated("an upstream figure cited with its source") for f in (
        "10 s", "306-327 s", "17.3 s", "60 s", "4.7 s", "15 s", "7.51 s", "5.03 s", "70 s", "4.19 s", "132 s",
        "34.11 s", "17 s", "65 s", "34.9 s", "23.1 s", "93%")},
}


def guide_pages() -> list[str]:
    return sorted(p.name for p in DOCS.glob("*.md"))


@pytest.mark.parametrize("page", guide_pages())
def test_every_figure_in_the_prose_has_a_source(page):
    listed = PAGES.get(page, {})
    shown = figures(page)
    typed = sorted(shown - set(listed))
    assert not typed, (f"docs/{page} shows figures with no source: {typed}. Quote a record through "
                       f"tools/doc_tables.py, or list the figure in {Path(__file__).name} with its record")
    gone = sorted(set(listed) - shown)
    assert not gone, f"{Path(__file__).name} lists figures docs/{page} no longer shows: {gone}"


CHECKED = [(page, fig, src) for page, figs in PAGES.items() for fig, src in figs.items()
           if isinstance(src, (Record, Code, Shown))]


@pytest.mark.parametrize(("page", "figure", "source"), CHECKED, ids=[f"{p}:{f}" for p, f, _ in CHECKED])
def test_each_measured_figure_is_what_its_source_says(page, figure, source):
    assert source.value() == figure, f"docs/{page} says {figure!r}; its source says {source.value()!r}"


def test_the_extractor_finds_a_figure_changed_by_hand():
    """The negative control: the changes the audit made by hand (issue 56) are figures with no source."""
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    for was, typed in (("x32.07", "x52.07"), ("35.9 ms", "15.9 ms"), ("94 tokens/s", "194 tokens/s")):
        assert was in prose(text)
        found = set(FIGURE.findall(prose(text).replace(was, typed)))
        assert typed in found and typed not in PAGES["benchmarks.md"], typed
