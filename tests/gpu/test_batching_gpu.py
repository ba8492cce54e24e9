"""Continuous batching on a GPU (engine/worker/gpu_steps.py): every request gets the tokens it gets alone,
greedy and seeded, through CUDA graphs of fixed shapes, with more sequences than one tile (the last
tile overlaps the one before), and the same tokens again with ``--enforce-eager``.

On a GPU the matrix kernels are chosen by the number of rows, so these tests fail whenever a pass's
shape depends on which other requests run (as a batch padded to its own size did at 66f5602: 0 of
64 llama-8b texts matched their lone runs on an H200)."""

from __future__ import annotations

import pytest
import torch
from batching_requests import REQUESTS, together
from wcache.core.checkpoint import make_checkpoint
from wcache.core.config import EngineConfig
from wcache.engine.worker import gpu_steps
from wcache.engine.core.engine import Engine
from wcache.engine.worker.gpu_steps import TILE_ROWS
from wcache.engine.worker.runner import EngineOptions
from wcache.engine.worker.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; run `make test-gpu` on one"),
]
SLOTS = TILE_ROWS + 16  # two tiles, the second overlapping the first by 48 slots
PROMPT_GRAPH_MAX = 64  # (tiny's slots are 512 positions, the default bucket limit: lowered so that
# the longer prompts here run eagerly)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("batching-gpu") / "tiny", "tiny")


def start(tiny, **options) -> Engine:
    cfg = EngineConfig.build(str(tiny), "bfloat16", None, "cuda")
    return Engine.start(cfg, EngineOptions("safetensors", enable_autotune=False, max_num_seqs=SLOTS, **options))


@pytest.fixture(scope="module")
def graphed(tiny):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_steps, "PROMPT_GRAPH_MAX", PROMPT_GRAPH_MAX)
        eng = start(tiny)
    assert eng.runner.gpu.prompt_max == PROMPT_GRAPH_MAX
    yield eng
    eng.close()


def tokens_of(completions) -> list[list[int]]:
    return [c.token_ids for c in completions]


def test_a_batch_on_the_gpu_gives_every_request_the_tokens_it_gets_alone(graphed):
    alone = [graphed.generate(p, n, s, stop) for p, n, s, stop in REQUESTS]
    batched = together(lambda i: graphed.generate(*REQUESTS[i]), len(REQUESTS))
    assert tokens_of(batched) == tokens_of(alone)
    gpu = graphed.runner.gpu
    assert gpu is not None and gpu._captured, "the passes ran without CUDA graphs"
    assert graphed.memory.graph_pool > 0, graphed.memory  # the graphs' pool is in the memory plan


def test_more_sequences_than_a_tile_and_long_prompts_keep_their_tokens(graphed):
    # Requests beyond the first tile run in the second, overlapping one; some prompts are longer than
    # the graphed prompt buckets and run eagerly, alone.
    n = SLOTS - 4
    requests = [(f"{'long ' * (PROMPT_GRAPH_MAX // 4) if i % 10 == 0 else ''}Sequence {i}", 12 + i % 5,
                 SamplingParams() if i % 2 else SamplingParams(0.9, 0.95, 500 + i), ()) for i in range(n)]
    alone = [graphed.generate(*r) for r in requests[:12]]
    batched = together(lambda i: graphed.generate(*requests[i]), n)
    assert tokens_of(batched[:12]) == tokens_of(alone)
    assert tokens_of(batched[12:]) == tokens_of([graphed.generate(*r) for r in requests[12:]])


def test_enforce_eager_gives_the_tokens_of_the_graphs(tiny, graphed):
    eager = start(tiny, enforce_eager=True)
    try:
        assert eager.runner.gpu is not None and not eager.runner.gpu.graphs
        want = tokens_of(together(lambda i: graphed.generate(*REQUESTS[i]), len(REQUESTS)))
        assert tokens_of(together(lambda i: eager.generate(*REQUESTS[i]), len(REQUESTS))) == want
        assert not eager.runner.gpu._captured
    finally:
        eager.close()


def test_a_request_that_joins_a_decoding_batch_keeps_its_tokens(graphed):
    # The joining request's prompt runs in a step whose decode tile covers its slot while it is not
    # decoding yet: that idle row must not write over the prompt's keys (it did at b43d6f0).
    import threading

    long_one, short_one = ("A long answer", 200, SamplingParams(), ()), ("A short one", 24, SamplingParams(), ())
    alone = [graphed.generate(*long_one), graphed.generate(*short_one)]
    decoding, out = threading.Event(), {}

    def run_long():
        out["long"] = graphed.generate(*long_one, on_text=lambda piece: decoding.set() or False)

    t = threading.Thread(target=run_long)
    t.start()
    assert decoding.wait(60)
    out["short"] = graphed.generate(*short_one)
    joined_while_decoding = "long" not in out  # the long one was still running when the short one ended
    t.join(120)
    assert joined_while_decoding, "the short request did not join while the long one decoded"
    assert tokens_of([out["long"], out["short"]]) == tokens_of(alone)


def test_the_steps_record_gpu_time_idle_time_and_row_buckets(graphed):
    # engine/core/step_clock.py on a GPU: CUDA events give each busy period's device time and the idle
    # between steps; a lone request computes 1 row a step (its bucket), a batch more.
    graphed.generate("A long answer", 12)  # (its first 200 tokens have no EOS: the test above)
    lone = graphed.clock.as_json()["busy_periods"][-1]["decode_steps"]
    assert lone["rows"] == 1 and lone["graph_rows"] == 1, lone
    together(lambda i: graphed.generate(*REQUESTS[i]), len(REQUESTS))
    many = graphed.clock.as_json()["busy_periods"][-1]
    for p in (lone, many, many["decode_steps"]):
        assert p["gpu_ms"] > 0 and p["gpu_idle_ms"] is not None and p["gpu_idle_ms"] >= 0, p
        assert 0 < p["host_ms"] <= p["step_ms"] and p["profile"]["gpu_wait_ms"] > 0, p
    assert many["decode_steps"]["rows"] > 1 and many["decode_steps"]["graph_rows"] >= many["decode_steps"]["rows"]
    assert "gpu_null_because" not in graphed.clock.as_json()
