"""Memory accounting in-process: sizes, the budget identity, the CPU activation tracker, the errors,
and a real Engine sized by the budget."""

from __future__ import annotations

import json

import pytest
import torch
from wcache.engine.worker import memory
from wcache.core.config import EngineConfig, Ranks
from wcache.core.disk import load_processed
from wcache.engine.core.engine import Engine
from wcache.engine.worker.runner import EngineOptions
from wcache.errors import ExternalWeightsExceedBudgetError, FreeMemoryError, KVCacheBudgetError
from wcache.model.llama import bind_weights, build_meta_model

MiB = 1 << 20


@pytest.mark.parametrize("text, n", [("1024", 1024), ("8GiB", 8 << 30), ("1.5 MiB", 3 << 19), ("2gb", 2 * 10**9),
                                     ("512KiB", 512 << 10), ("7B", 7)])
def test_parse_bytes(text, n):
    assert memory.parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "8x", "-1GiB", "0", "GiB", "1e9"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="is not a"):
        memory.parse_bytes(text)


def test_format_bytes():
    assert memory.format_bytes(0) == "0 B"
    assert memory.format_bytes(1536) == "1.50 KiB"
    assert memory.format_bytes(3 << 30) == "3.00 GiB"


def test_kv_bytes_per_token_matches_the_allocated_cache(tiny_model):
    for ranks in (Ranks(), Ranks(tp_size=2, tp_rank=1), Ranks(pp_size=2, pp_rank=1)):
        cfg = EngineConfig.build(str(tiny_model), device="cpu", ranks=ranks)
        model = build_meta_model(cfg.shape, cfg.quant, cfg.dtype)  # a meta cache has real sizes
        real = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in model.new_cache(10)) // 10
        assert memory.kv_bytes_per_token(cfg.shape, cfg.dtype) == real


def test_plan_identity():
    plan = memory.MemoryPlan("cpu", capacity=100 * MiB, utilization=0.5, own_weights=10 * MiB,
                             external_weights=20 * MiB, activation_peak=3 * MiB, kv_bytes_per_token=1000)
    assert plan.budget == 50 * MiB
    assert plan.own_weights + plan.external_weights + plan.activation_peak + plan.kv_cache_bytes == plan.budget
    assert plan.kv_tokens == (17 * MiB) // 1000
    assert "budget 0.5 x 100.00 MiB = 50.00 MiB = own weights 10.00 MiB + external weights 20.00 MiB" in plan.split()
    short = memory.MemoryPlan("cpu", 10 * MiB, 0.5, 4 * MiB, 0, 2 * MiB, 1000)
    assert short.kv_cache_bytes < 0 and short.kv_tokens == 0


def test_the_spare_reserve_is_left_out_of_the_kv_cache():
    """--respawn: the hot spare's device reserve is a term of the budget, so the serving worker and
    its spare never over-commit the device; without a spare the split reads as before."""
    plan = memory.MemoryPlan("cpu", capacity=100 * MiB, utilization=0.5, own_weights=10 * MiB,
                             external_weights=20 * MiB, activation_peak=3 * MiB, kv_bytes_per_token=1000,
                             spare_reserve=7 * MiB)
    assert (plan.own_weights + plan.external_weights + plan.activation_peak + plan.spare_reserve
            + plan.kv_cache_bytes == plan.budget)
    assert plan.kv_tokens == (10 * MiB) // 1000
    assert "activation peak 3.00 MiB + spare reserve 7.00 MiB + KV cache 10.00 MiB" in plan.split()
    assert json.loads(plan.as_json())["spare_reserve"] == 7 * MiB
    assert "spare reserve" not in memory.MemoryPlan("cpu", 100 * MiB, 0.5, 0, 0, 0, MiB).split()


def test_external_weights_exceed_budget_message():
    with pytest.raises(ExternalWeightsExceedBudgetError) as e:
        memory.check_external(capacity=10 * MiB, utilization=0.5, external=6 * MiB)
    assert str(e.value) == ("Externally held weights (6.00 MiB) exceed the desired GPU memory utilization "
                            "(0.5 x 10.00 MiB = 5.00 MiB); raise --gpu-memory-utilization to at least 0.60 for the "
                            "weights alone (activations and the KV cache need more: the next start names the least "
                            "share that holds them all)")
    with pytest.raises(ExternalWeightsExceedBudgetError, match="exceed the desired CPU memory utilization"):
        memory.check_external(capacity=10 * MiB, utilization=0.5, external=6 * MiB, device_type="cpu")
    with pytest.raises(ExternalWeightsExceedBudgetError, match="exceed the device's capacity"):
        memory.check_external(capacity=10 * MiB, utilization=0.9, external=11 * MiB)
    memory.check_external(capacity=10 * MiB, utilization=0.6, external=6 * MiB)  # fits exactly


def test_peak_tracker_counts_new_storages_once():
    outside = torch.zeros(MiB // 4)  # 1 MiB that exists before: never counted, even through views
    with memory.PeakTracker() as t:
        a = torch.zeros(MiB // 4)  # 1 MiB
        b = a + 1  # 2 MiB live
        v = a[10:]  # a view: no new bytes
        w = outside[5:]  # a view of an outside tensor: not counted
        del b
        c = a * 2  # back to 2 MiB live, peak stays 2 MiB
        d = outside + 0  # 3 MiB
        del c, d, v, w
    assert t.peak == 3 * MiB
    assert t.live == MiB  # only `a` is still alive
    del a
    assert t.live == 0


def test_activation_peak_is_measured_and_grows_with_tokens(tiny_model):
    cfg = EngineConfig.build(str(tiny_model), device="cpu")
    model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), load_processed(cfg, False).bindable())
    small, large = memory.measure_activation_peak(model, 32), memory.measure_activation_peak(model, 256)
    # At least the logits, the hidden state and the attention scores of one layer.
    assert small >= 32 * cfg.shape.hidden_size * 2
    assert large > 4 * small  # attention scores grow with T^2
    assert memory.measure_activation_peak(model, 256) == large  # deterministic on CPU


def test_max_model_len_from_the_budget():
    plan = memory.MemoryPlan("cpu", 100 * MiB, 0.5, 0, 0, 0, MiB)  # 50 tokens fit
    assert memory.size_max_model_len(plan, None, 2048, 512) == 50
    assert memory.size_max_model_len(plan, 40, 2048, 512) == 40
    with pytest.raises(KVCacheBudgetError, match=r"^--max-model-len 60 needs 60 KV cache tokens but the memory "
                                                 r"budget holds 50: budget 0\.5 x"):
        memory.size_max_model_len(plan, 60, 2048, 512)
    empty = memory.MemoryPlan("cpu", 100 * MiB, 0.5, 50 * MiB, 0, 0, MiB)
    with pytest.raises(KVCacheBudgetError, match=r"^No memory left for the KV cache: budget"):
        memory.size_max_model_len(empty, None, 2048, 512)


def kv_error(plan, requested, default=20) -> str:
    with pytest.raises(KVCacheBudgetError) as e:
        memory.size_max_model_len(plan, requested, default, 512)
    return str(e.value).split(". ", 1)[1]  # the way out, after the split


def test_the_kv_cache_error_names_the_way_out_that_works():
    """A higher utilization only where one below 1 holds everything; --max-model-len when the
    activation peak over it (or the sequence) is what does not fit; the weights alone too big."""
    gpu = dict(device="cuda", capacity=100 * MiB, utilization=0.5, external_weights=0, kv_bytes_per_token=MiB)
    assert kv_error(memory.MemoryPlan(own_weights=50 * MiB, activation_peak=0, **gpu), None) == (
        "Raise --gpu-memory-utilization to at least 0.70 (the GPU must have that much free: memory other processes "
        "hold is not counted), or lower --max-model-len (the activation peak, 0 B, is measured over 20 tokens and "
        "shrinks with them)")
    # The activation peak over 20 tokens (95 MiB) with the weights exceeds the card: no utilization helps.
    assert kv_error(memory.MemoryPlan(own_weights=10 * MiB, activation_peak=95 * MiB, **gpu), None) == (
        "No utilization fits: the weights, the activation peak over 20 tokens (95.00 MiB) and one sequence of 20 "
        "tokens need 125.00 MiB of the device's 100.00 MiB. Lower --max-model-len")
    assert kv_error(memory.MemoryPlan(own_weights=120 * MiB, activation_peak=0, **gpu), None) == (
        "The weights alone need 120.00 MiB of the device's 100.00 MiB: give each rank a smaller share of the model "
        "(more tensor or pipeline parallelism)")
    fifty = memory.MemoryPlan("cpu", 100 * MiB, 0.5, 0, 0, 0, MiB)  # 50 tokens fit
    assert kv_error(fifty, 60) == ("Raise --gpu-memory-utilization to at least 0.60, or --cpu-memory-capacity, or "
                                   "lower --max-model-len to at most 50")
    assert kv_error(fifty, 200).endswith("need 200.00 MiB of the device's 100.00 MiB. Lower --max-model-len to "
                                         "at most 50")


def test_engine_sizes_and_uses_its_kv_cache(tiny_model, wcache_env):
    """A real engine from disk: the plan adds up, the KV cache it allocates is the sized one, and a
    request longer than the budget allows is refused by the HTTP layer's length check."""
    cfg = EngineConfig.build(str(tiny_model), device="cpu")
    weights = load_processed(cfg, False).nbytes
    per_token = memory.kv_bytes_per_token(cfg.shape, cfg.dtype)
    probe = Engine.start(cfg, EngineOptions("safetensors", enable_autotune=False))
    act = probe.memory.activation_peak
    assert probe.max_model_len == 512 and probe.memory.own_weights == weights and probe.memory.external_weights == 0
    capacity = weights + act + 100 * per_token + 17  # room for exactly 100 tokens at utilization 1.0
    engine = Engine.start(cfg, EngineOptions("safetensors", cpu_memory_capacity=capacity, gpu_memory_utilization=1.0,
                                             enable_autotune=False))
    assert engine.memory.kv_tokens == 100 and engine.max_model_len == 100
    assert sum(k.nbytes + v.nbytes for k, v in engine.kv_cache) == 100 * per_token
    _, ids, _, n_prompt = engine.complete("Hello", 10)
    assert len(ids) == 10 and n_prompt == 4  # BOS and Hello's 3 tokens (tiny's tokenizer.json)
    # Asking for 512 explicitly (the activation peak is the same as the probe's) is an error, not a cap.
    with pytest.raises(KVCacheBudgetError, match="--max-model-len 512 needs 512 KV cache tokens but the memory "
                                                 "budget holds 100"):
        Engine.start(cfg, EngineOptions("safetensors", max_model_len=512, cpu_memory_capacity=capacity,
                                        gpu_memory_utilization=1.0, enable_autotune=False))


GiB = 1 << 30


def test_free_memory_check_refuses_what_other_processes_hold():
    """The start check, with numbers: 80 GiB card, the plan still needs 60 GiB (a KV cache bounded by
    the budget), another process holds 21 GiB: refused, with upstream's first sentence and advice and
    the utilization that fits what is free."""
    memory.check_free_memory(free=75 * GiB, total=80 * GiB, utilization=0.9, counted=0, needed=60 * GiB)
    with pytest.raises(FreeMemoryError) as e:
        memory.check_free_memory(free=59 * GiB, total=80 * GiB, utilization=0.9, counted=0, needed=60 * GiB)
    assert str(e.value) == (
        "Free memory on device (59.00/80.00 GiB) on startup is less than this engine still needs (60.00 GiB for "
        "its KV cache, CUDA graphs and activations, within GPU memory utilization 0.9, 72.00 GiB). Decrease GPU "
        "memory utilization or reduce GPU memory used by other processes. --gpu-memory-utilization 0.73 fits "
        "what is free now")
    with pytest.raises(FreeMemoryError, match="no utilization fits what is free now"):
        memory.check_free_memory(free=GiB // 2, total=80 * GiB, utilization=0.5, counted=0, needed=GiB)


def test_free_memory_check_asks_only_for_what_the_plan_allocates():
    """A small model's KV cache is --max-num-seqs x --max-model-len tokens, far below its budget: 2 GiB
    free holds what it still needs (1 GiB) beside other processes, where comparing free memory with
    the whole budget (vLLM's check, whose KV cache takes all the budget) would refuse it, and every
    engine of the GPU tier's workers side by side."""
    memory.check_free_memory(free=2 * GiB, total=80 * GiB, utilization=0.9, counted=0, needed=GiB)


def test_free_memory_check_counts_the_daemons_weights_inside_the_budget():
    """zero_copy: the daemon's 16 GiB are on the device before the engine starts, so not free, yet
    inside the budget: the utilization that fits counts them (free 40 + 16 of 80 GiB: 0.70)."""
    memory.check_free_memory(free=63 * GiB, total=80 * GiB, utilization=0.9, counted=16 * GiB, needed=56 * GiB)
    with pytest.raises(FreeMemoryError) as e:
        memory.check_free_memory(free=40 * GiB, total=80 * GiB, utilization=0.9, counted=16 * GiB, needed=56 * GiB)
    assert str(e.value).endswith("--gpu-memory-utilization 0.70 fits what is free now")


def test_free_memory_check_skips_a_cpu_device():
    """On CPU the capacity is a setting (--cpu-memory-capacity); there is no free figure to compare."""
    memory.check_device_free(torch.device("cpu"), 0.99, counted=0, needed=1 << 60)


def test_a_cuda_out_of_memory_is_named_not_a_traceback():
    """The conversion alone (the GPU test provokes a real one); a CPU error passes through untouched."""
    with pytest.raises(ValueError):
        with memory.out_of_memory_named(torch.device("cpu"), 0.9, "sizing"):
            raise ValueError("not memory")


def test_a_refusal_waits_while_a_dead_processs_memory_comes_back():
    """A promoted --respawn spare may read the free memory while the dead worker's is still being
    given back: the check reads again for FREE_SETTLE_S, then while it grows; memory that stays
    taken is refused once FREE_SETTLE_S is over, and growth never holds it past FREE_SETTLE_MAX_S."""
    def run(frees):
        t, reads = [0.0], iter(frees)

        def sleep(s):
            t[0] += s

        def refuse_below_10_gib(free):
            if free < 10 * GiB:
                raise FreeMemoryError(f"{free}")
        try:
            memory.settle_free(lambda: next(reads), refuse_below_10_gib, clock=lambda: t[0], sleep=sleep)
            return "ok", t[0]
        except FreeMemoryError:
            return "refused", t[0]

    # Back after 4 s, growing from 3 s on: it waits and passes.
    assert run([GiB] * 6 + [3 * GiB, 6 * GiB, 10 * GiB]) == ("ok", 4.0)
    # Taken for good: refused once FREE_SETTLE_S is over.
    assert run([GiB] * 100) == ("refused", memory.FREE_SETTLE_S)
    # Growing forever: refused at FREE_SETTLE_MAX_S.
    assert run([i * 16 << 20 for i in range(1000)]) == ("refused", memory.FREE_SETTLE_MAX_S)
