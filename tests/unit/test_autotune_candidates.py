"""The autotune pass in-process: every candidate computes F.linear, winners apply deterministically,
the cache key and file name, atomic writes, and warm starts that run no trial."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from wcache.core import autotune
from wcache.core.config import EngineConfig, Ranks
from wcache.core.disk import load_processed
from wcache.model.llama import bind_weights, build_meta_model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(autotune.CPU_CANDIDATES))
def test_each_candidate_equals_f_linear(name, dtype):
    gen = torch.Generator().manual_seed(1)
    for n, k, m in [(256, 128, 1), (384, 128, 16), (128, 384, 5), (130, 64, 3)]:
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
        x = torch.randn(m, k, generator=gen).to(dtype)
        out = autotune.ALL[name](x, w)
        assert out.shape == (m, n) and out.dtype == dtype
        torch.testing.assert_close(out.float(), F.linear(x, w).float(), **autotune.tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-only candidates need a CUDA device")
@pytest.mark.parametrize("name", sorted(set(autotune.CUDA_CANDIDATES) - set(autotune.CPU_CANDIDATES)))
def test_each_cuda_candidate_equals_f_linear(name):
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) / 16
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(autotune.ALL[name](x, w).float(), F.linear(x, w).float(),
                               **autotune.tolerance(torch.bfloat16))


def test_selected_picks_the_bucket_winner():
    sel = autotune.Selected({1: "chunked2", 16: "linear"})
    assert [fn for _, fn in sel.fns] == [autotune.ALL["chunked2"], autotune.ALL["linear"]]
    seen = []

    def recorder(tag):
        return lambda x, w: seen.append(tag)

    sel.fns = [(m, recorder(m)) for m, _ in sel.fns]
    for t in (1, 5, 15, 16, 300):
        sel(torch.zeros(t, 4), torch.zeros(3, 4))
    assert seen == [1, 1, 1, 16, 16]


@pytest.fixture
def tiny_cfg(tiny_model, wcache_env):
    return EngineConfig.build(str(tiny_model), device="cpu")


def test_whichever_impl_wins_the_model_output_is_the_same(tiny_cfg):
    model = bind_weights(build_meta_model(tiny_cfg.shape, tiny_cfg.quant, tiny_cfg.dtype),
                         load_processed(tiny_cfg, False).bindable())
    ids = torch.tensor([256, 72, 101, 108, 108, 111])
    ref = model(ids, 0, model.new_cache(6))
    names = {p: autotune.projection_shapes(tiny_cfg)[p] for p in autotune.PROJECTIONS}
    for impl in autotune.CPU_CANDIDATES:
        configs = {autotune.config_name(p, n, k, m): {"impl": impl} for p, (n, k) in names.items()
                   for m in autotune.TOKEN_BUCKETS}
        used = autotune.apply(model, configs)
        assert used == {impl: 4 * tiny_cfg.shape.num_layers}
        torch.testing.assert_close(model(ids, 0, model.new_cache(6)), ref, rtol=0.05, atol=0.05)


def test_key_is_the_same_for_daemon_and_engine_and_names_the_file(tiny_model, tiny_cfg, tmp_path, monkeypatch):
    engine_side = EngineConfig.build(str(tiny_model), "auto", None, "cpu")  # what `serve` builds
    daemon_side = EngineConfig.build(str(tiny_model), "auto", None, "cpu", ranks=Ranks(), revision=None)
    assert autotune.tune_key(engine_side) == autotune.tune_key(daemon_side)
    assert autotune.cache_path(engine_side) == autotune.cache_path(daemon_side)
    assert autotune.cache_path(engine_side).parent == autotune.cache_dir()
    assert str(autotune.cache_dir()).startswith(os.environ["WCACHE_CACHE_ROOT"])
    monkeypatch.setenv("WCACHE_AUTOTUNE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert autotune.cache_path(engine_side).parent == tmp_path / "elsewhere"
    other = {
        "dtype": EngineConfig.build(str(tiny_model), "float32", None, "cpu"),
        "quantization": EngineConfig.build(str(tiny_model), "auto", "int8", "cpu"),
        "tp_rank": EngineConfig.build(str(tiny_model), "auto", None, "cpu", ranks=Ranks(tp_size=2, tp_rank=1)),
    }
    base = autotune.tune_key(engine_side)
    for field, cfg in other.items():
        assert field in autotune.mismatched_fields(base, autotune.tune_key(cfg))
        assert autotune.cache_path(cfg) != autotune.cache_path(engine_side)


def test_tune_then_warm_start_runs_no_trial(tiny_cfg):
    path = autotune.cache_path(tiny_cfg)
    before = autotune.TRIALS
    doc, p, trials = autotune.load_or_tune(tiny_cfg, "test")
    shapes = autotune.projection_shapes(tiny_cfg)
    expected_configs = len(shapes) * len(autotune.TOKEN_BUCKETS)
    assert p == path and len(doc["configs"]) == expected_configs
    assert trials == expected_configs * len(autotune.CPU_CANDIDATES) == autotune.TRIALS - before
    on_disk = json.loads(path.read_text())
    assert on_disk["configs"] == doc["configs"] and on_disk["key"] == autotune.tune_key(tiny_cfg)
    assert all(c["impl"] in autotune.CPU_CANDIDATES and "linear" in c["us"] for c in on_disk["configs"].values())
    assert [f.name for f in path.parent.iterdir()] == [path.name]  # no temp file left behind
    again, _, trials = autotune.load_or_tune(tiny_cfg, "test")
    assert trials == 0 and autotune.TRIALS - before == expected_configs * len(autotune.CPU_CANDIDATES)
    assert again["configs"] == doc["configs"]


def test_a_corrupt_or_foreign_cache_is_retuned(tiny_cfg, caplog):
    path = autotune.cache_path(tiny_cfg)
    path.parent.mkdir(parents=True)
    path.write_text('{"format": "wcache-autotune", "key": {"dtype": "float32"}, "configs": {}}')
    _, _, trials = autotune.load_or_tune(tiny_cfg, "test")
    assert trials > 0 and "made for another configuration" in caplog.text
    path.write_text("{not json")
    _, _, trials = autotune.load_or_tune(tiny_cfg, "test")
    assert trials > 0 and "cannot read" in caplog.text
    doc = json.loads(path.read_text())
    doc["configs"][next(iter(doc["configs"]))]["impl"] = "os.system"
    path.write_text(json.dumps(doc))
    with pytest.raises(autotune.AutotuneError, match="names no known implementation"):
        autotune.load(path, autotune.tune_key(tiny_cfg))


def test_save_failure_raises_and_leaves_no_temp(tiny_cfg, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("WCACHE_AUTOTUNE_CACHE_DIR", str(blocker / "autotune"))
    with pytest.raises(autotune.AutotuneError, match="cannot write"):
        autotune.load_or_tune(tiny_cfg, "daemon")  # the daemon's pass: fatal
    _, _, trials = autotune.load_or_tune(tiny_cfg, "engine", save_errors_fatal=False)  # the engine: a warning
    assert trials > 0
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setenv("WCACHE_AUTOTUNE_CACHE_DIR", str(ro))
    doc = {"format": autotune.FORMAT, "configs": {}}
    autotune.save(ro / "x.json", doc)
    assert json.loads((ro / "x.json").read_text()) == doc and os.listdir(ro) == ["x.json"]
