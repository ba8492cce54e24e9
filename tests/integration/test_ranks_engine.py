"""The multi-rank engine's numerics: this test process is engine rank 0 and drives a real worker
process over gloo, recording the logits of every decoding step.

Tolerance: tensor parallelism splits the two row-parallel projections of each layer into partial
sums that an all-reduce adds, which reorders float additions. With a float32 checkpoint the logits
of TP=2 stay within TP_ATOL (absolute) of TP=1 at every step and the greedy tokens are equal.
Pipeline parallelism hands the exact hidden states from stage to stage, so PP=2 is bit-identical.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from procs import free_port
import prompt_ids as tokenizer
from wcache.core.checkpoint import make_checkpoint
from wcache.cli import build_parser
from wcache.errors import KVCacheBudgetError
from wcache.engine.loading.config import parse_loader_config
from wcache.core.settings import from_flags
from wcache.engine.core.engine import rank_specs
from wcache.engine.core.settings import EngineSettings
from wcache.engine.worker.runner import OP_STOP, RankRunner
from wcache.engine.worker.supervisor import spawn_worker

TP_ATOL = 1e-5  # logits of this model are O(1); float32 reordering moves them by about 2e-7
PROMPT = tokenizer.encode("The weight cache keeps")
STEPS = 12


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ranks-engine") / "tiny32", "tiny", dtype="float32")


@contextmanager
def engine(model, *flags: str):
    """(rank 0's started runner, the worker processes) of an engine whose rank 0 is this process."""
    args = build_parser().parse_args(["serve", str(model), "--device", "cpu", "--master-port", str(free_port()),
                                      "--no-enable-autotune", *flags])
    _, specs = rank_specs(from_flags(EngineSettings, args), parse_loader_config(None))
    workers = [spawn_worker(s) for s in specs[1:]]
    try:
        runner = RankRunner.from_spec(specs[0])
        yield runner, workers
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def generate_and_stop(runner, workers, prompt: list[int], steps: int) -> list[int]:
    out = runner.decode(prompt, steps, None)  # every forward pass announced to the workers
    runner.send_op(OP_STOP)
    assert [w.wait(60) for w in workers] == [0] * len(workers)  # every worker stopped cleanly
    return out


def drive(model, *flags: str) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step logits of an engine whose rank 0 is this process."""
    with engine(model, *flags) as (runner, workers):
        runner.start()
        runner.trace = []
        return generate_and_stop(runner, workers, PROMPT, STEPS), runner.trace


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


def test_tp2_every_rank_sizes_its_kv_cache_from_the_memory_flags(model32):
    """--gpu-memory-utilization and --cpu-memory-capacity reach every rank: each splits its own
    budget (memory.py), the ranks agree on the engine's length, and a length that does not fit is
    refused on every rank (the worker exits 2, as the serve process does)."""
    with engine(model32, "-tp", "2", "--cpu-memory-capacity", "64GiB") as (runner, workers):
        runner.start()  # a probe: this rank's weights, activation peak and KV bytes per token
        probe = runner.memory
        generate_and_stop(runner, workers, PROMPT, 1)
    assert probe.capacity == 64 * 2**30 and probe.utilization == 0.9
    # Room for exactly 100 tokens in half of the capacity; both TP ranks hold the same shard sizes.
    capacity = 2 * (probe.own_weights + probe.activation_peak + 100 * probe.kv_bytes_per_token) + 34
    flags = ("-tp", "2", "--gpu-memory-utilization", "0.5", "--cpu-memory-capacity", str(capacity))
    with engine(model32, *flags) as (runner, workers):
        runner.start()
        assert (runner.memory.capacity, runner.memory.utilization) == (capacity, 0.5)
        assert runner.memory.kv_tokens == 100 and runner.max_model_len == 100
        # One sequence of 100 tokens fits (the default --max-num-seqs is lowered to what the budget holds).
        assert runner.num_seqs == 1
        assert sum(k.nbytes + v.nbytes for k, v in runner.kv_cache) == 100 * probe.kv_bytes_per_token
        # The longest request the engine accepts runs on both ranks, in their 100-token caches.
        assert len(generate_and_stop(runner, workers, PROMPT, 100 - len(PROMPT))) == 100 - len(PROMPT)
    # The activation peak is the probe's at the model's own length (512): room for 100 tokens again.
    with engine(model32, *flags, "--max-model-len", "512") as (runner, workers):
        with pytest.raises(KVCacheBudgetError, match="--max-model-len 512 needs 512 KV cache tokens but the memory "
                                                     "budget holds 100"):
            runner.start()
        assert [w.wait(60) for w in workers] == [2]


@pytest.fixture(scope="module")
def model16(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ranks-engine-bf16") / "tiny16", "tiny")


@pytest.mark.parametrize("layout", [("-tp", "2"), ("-pp", "2")], ids=["tp2", "pp2"])
def test_ranks_batch_in_lockstep(model16, layout):
    """Several requests at once on a two-rank engine: rank 0's scheduler batches them, every pass
    is announced to the worker in one header, and each request gets the tokens it gets alone
    (greedy and seeded sampling); the worker stops cleanly."""
    import threading

    from wcache.engine.core.engine import Engine
    from wcache.engine.worker.sampling_params import SamplingParams

    prompts = [f"Request {i} asks" for i in range(6)]
    params = [SamplingParams() if i % 2 else SamplingParams(0.9, 0.95, 7 + i) for i in range(6)]
    with engine(model16, *layout) as (runner, workers):
        runner.start()
        eng = Engine(runner)
        try:
            alone = [eng.generate(p, 24, s).token_ids for p, s in zip(prompts, params)]
            before = (eng.stats.steps, eng.stats.tokens)
            batched = [None] * len(prompts)
            start = threading.Barrier(len(prompts))

            def run(i):
                start.wait()
                batched[i] = eng.generate(prompts[i], 24, params[i]).token_ids

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            steps, tokens = eng.stats.steps - before[0], eng.stats.tokens - before[1]
        finally:
            eng.close()
        assert [w.wait(60) for w in workers] == [0] * len(workers)
    assert batched == alone
    # Alone, a step gives a request at most 2 tokens (its prompt's pass, then a decode pass): more
    # per step means passes decoded several sequences at once.
    assert tokens > 2 * steps
