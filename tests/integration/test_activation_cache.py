"""The activation-peak measurement is remembered like the autotune results: a restart with the same
model, kernels and device reads the record instead of running the profiling forward again. The
measurement itself runs for real here (a CPU forward of the tiny model); the test only counts it.
The break it catches: a record read back for another length or another padding (a count of
measurements that stays short), or a record that is never written (the restart measures again)."""

from __future__ import annotations

import json

from wcache.core.config import EngineConfig
from wcache.core.disk import load_processed
from wcache.engine.worker import memory
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
    measure = memory._measure_activation_peak  # counted, and still run: every figure below is measured

    def counted(m, tokens):
        calls.append(tokens)
        return measure(m, tokens)

    monkeypatch.setattr(memory, "_measure_activation_peak", counted)
    assert memory.measure_activation_peak(_model(tiny_model), 64) == first  # a restarted engine
    assert calls == [] and "measured by an earlier start" in caplog.text
    shorter = memory.measure_activation_peak(model, 32)  # another length: measured, and recorded
    assert calls == [32] and 0 < shorter < first, (shorter, first)
    assert json.loads(memory._activation_path(memory.activation_key(model, 32)).read_text())["bytes"] == shorter
    padded = _model(tiny_model)
    padded.warm_rows(64, 64)  # rows padded (CPU, bfloat16): another profile, measured again
    assert memory.measure_activation_peak(padded, 32) > 0 and calls == [32, 32]
    calls.pop()
    path.write_text("{not json")  # a damaged record costs a measurement, never a wrong figure
    again = memory.measure_activation_peak(model, 64)
    assert calls == [32, 64] and again > 0 and json.loads(path.read_text())["bytes"] == again
