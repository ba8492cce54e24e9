"""The activation-peak measurement is remembered like the autotune results: a restart with the same
model, kernels and device reads the record instead of running the profiling forward again."""

from __future__ import annotations

import json

from wcache.core.config import EngineConfig
from wcache.core.disk import load_processed
from wcache.engine import memory
from wcache.model.llama import bind_weights, build_meta_model


def _model(path):
    cfg = EngineConfig.build(str(path), device="cpu")
    return bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), load_processed(cfg, False).bindable())


def test_a_restart_reuses_the_measured_peak_and_a_change_measures_again(tiny_model, wcache_env, caplog, monkeypatch):
    caplog.set_level("INFO", logger="wcache.memory")
    model = _model(tiny_model)
    first = memory.measure_activation_peak(model, 64)
    assert first > 0 and "measured in" in caplog.text
    path = memory._activation_path(memory.activation_key(model, 64))
    assert json.loads(path.read_text())["bytes"] == first
    caplog.clear()
    calls = []
    monkeypatch.setattr(memory, "_measure_activation_peak", lambda m, t: calls.append(t) or 1)
    assert memory.measure_activation_peak(_model(tiny_model), 64) == first  # a restarted engine
    assert calls == [] and "measured by an earlier start" in caplog.text
    assert memory.measure_activation_peak(model, 32) == 1 and calls == [32]  # another length: measured
    padded = _model(tiny_model)
    padded.warm_rows(64, 64)  # rows padded (CPU, bfloat16): another profile, measured again
    assert memory.measure_activation_peak(padded, 32) == 1 and calls == [32, 32]
    calls.pop()
    path.write_text("{not json")  # a damaged record costs a measurement, never a wrong figure
    assert memory.measure_activation_peak(model, 64) == 1 and calls == [32, 64]
