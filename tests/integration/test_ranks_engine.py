"""The multi-rank engine's numerics: this test process is engine rank 0 and drives a real worker
process over gloo, recording the logits of every decoding step.

Tolerance: tensor parallelism splits the two row-parallel projections of each layer into partial
sums that an all-reduce adds, which reorders float additions. With a float32 checkpoint the logits
of TP=2 stay within TP_ATOL (absolute) of TP=1 at every step and the greedy tokens are equal.
Pipeline parallelism hands the exact hidden states from stage to stage, so PP=2 is bit-identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from procs import free_port
from wcache.model import tokenizer
from wcache.core.checkpoint import make_checkpoint
from wcache.cli import build_parser
from wcache.engine.loader import parse_loader_config
from wcache.engine.workers import OP_GENERATE, OP_STOP, RankRunner, rank_specs, spawn_worker

TP_ATOL = 1e-5  # logits of this model are O(1); float32 reordering moves them by about 2e-7
PROMPT = tokenizer.encode("The weight cache keeps")
STEPS = 12


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ranks-engine") / "tiny32", "tiny", dtype="float32")


def drive(model, *flags: str) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step logits of an engine whose rank 0 is this process."""
    args = build_parser().parse_args(["serve", str(model), "--device", "cpu", "--master-port", str(free_port()),
                                      "--no-enable-autotune", *flags])
    _, specs = rank_specs(args, parse_loader_config(None))
    workers = [spawn_worker(s) for s in specs[1:]]
    try:
        runner = RankRunner(specs[0])
        runner.join()
        runner.load()
        runner.trace = []
        runner.send_request(OP_GENERATE, PROMPT, STEPS)
        out = runner.decode(PROMPT, STEPS, None)
        runner.send_request(OP_STOP)
        assert [w.wait(60) for w in workers] == [0] * len(workers)  # every worker stopped cleanly
        return out, runner.trace
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp1(model32):
    return drive(model32)


def test_tp2_matches_tp1_within_tolerance(model32, tp1):
    tokens, logits = drive(model32, "--tensor-parallel-size", "2")
    assert tokens == tp1[0]
    diffs = [float((a - b).abs().max()) for a, b in zip(logits, tp1[1])]
    assert len(diffs) == STEPS and max(diffs) <= TP_ATOL, diffs
    assert max(diffs) > 0.0  # the reduction really ran on two ranks (else TP=2 would be exact)


def test_pp2_is_bit_identical_to_tp1(model32, tp1):
    tokens, logits = drive(model32, "--pipeline-parallel-size", "2")
    assert tokens == tp1[0]
    assert len(logits) == STEPS and all(torch.equal(a, b) for a, b in zip(logits, tp1[1]))
