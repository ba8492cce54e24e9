"""FP8 served by real processes: a block-wise FP8 checkpoint from `wcache make-checkpoint`, and
`--quantization fp8` on an unquantized one, each read and post-processed once by a `wcache preload`
daemon and mapped by engines.

* The FP8 checkpoint: an engine reading the disk and one mapping the daemon's weights return
  exactly transformers' greedy token ids (transformers 5 loads the same files on CPU with
  ``FineGrainedFP8Config(dequantize=True)``, in float32, as hf_reference.py does); the cache's
  tensors are bit-for-bit the disk's (FP8 bytes and block scales), and the logits are within
  test_hf_parity's float32 tolerance of transformers'.
* Online FP8: the daemon quantizes once, the engine maps the result; the restart's saving (a disk
  read plus quantization against a map of the daemon's weights) is measured and printed, and an
  engine without ``--quantization fp8`` gets the cache key's field-level mismatch, never the FP8
  weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from procs import complete
from wcache.core.checkpoint import make_checkpoint
from wcache.core.config import EngineConfig
from wcache.errors import WeightCacheError
import prompt_ids as tokenizer
from wcache.model.llama import bind_weights, build_meta_model

HERE = Path(__file__).parent
PROMPT = "Hello, world"
IDS = tokenizer.preset_encode(PROMPT)  # as the served checkpoint's tokenizer.json encodes it
MAX_TOKENS = 12
TOLERANCE = 1e-5  # test_hf_parity's float32 tolerance: the up-cast weights are transformers' exactly
FLAGS = ("--no-enable-autotune", "--dtype", "float32")


def loader(socket_dir: str) -> dict:
    return {"fallback": False, "socket_dir": socket_dir}


def load(model_dir, load_format: str, socket_dir: str, quantization: str | None = None, dtype: str = "float32"):
    """(config, loaded weights) of an engine's loader in this process; ipc_cache without fallback."""
    from wcache.engine.loading.config import parse_loader_config
    from wcache.engine.loading.registry import load_weights

    cfg = EngineConfig.build(str(model_dir), dtype, quantization, "cpu")
    return cfg, load_weights(cfg, load_format, parse_loader_config(loader(socket_dir)))


def logits_of(cfg, loaded) -> torch.Tensor:
    model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), loaded.weights.bindable())
    return model(torch.tensor(IDS), 0, model.new_cache(len(IDS)), all_positions=True).float()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) \
        if a.dtype == torch.float8_e4m3fn else torch.equal(a, b) and a.dtype == b.dtype


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> Path:
    """What `wcache make-checkpoint DIR --preset tiny --quantization fp8` writes (the guide's
    configuration page runs the command itself)."""
    return make_checkpoint(tmp_path_factory.mktemp("fp8") / "tiny-fp8", "tiny", quantization="fp8")


@pytest.fixture(scope="module")
def transformers_reference(fp8_model, tmp_path_factory) -> dict:
    """What transformers computes from the FP8 files (float32, dequantized at load), in a subprocess."""
    tmp = tmp_path_factory.mktemp("hf-fp8")
    spec = [{"load": str(fp8_model), "out": str(tmp), "text": PROMPT, "max_tokens": MAX_TOKENS,
             "eos_id": tokenizer.EOS_ID, "fp8_dequantize": True}]
    (tmp / "spec.json").write_text(json.dumps(spec))
    p = subprocess.run([sys.executable, str(HERE / "hf_reference.py"), str(tmp / "spec.json")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((tmp / "reference.json").read_text())["float32"]


@pytest.fixture(scope="module")
def served(fp8_model, tiny_model, module_procs, module_env):
    """FP8 checkpoint: a daemon, a disk engine and a cache engine; online FP8: a daemon."""
    sockets = {"checkpoint": f"{module_env['TMPDIR']}/s-ckpt", "online": f"{module_env['TMPDIR']}/s-online"}
    daemon = module_procs.preload(fp8_model, *FLAGS, "--weight-cache-socket-dir", sockets["checkpoint"], ready=False,
                                  name="daemon-fp8")
    online = module_procs.preload(tiny_model, *FLAGS, "--quantization", "fp8", "--weight-cache-socket-dir",
                                  sockets["online"], ready=False, name="daemon-online")
    disk = module_procs.serve(fp8_model, *FLAGS, "--max-model-len", "64", name="disk-fp8")
    daemon.wait_for_log("Weight cache daemon READY")
    cached = module_procs.serve(fp8_model, *FLAGS, "--max-model-len", "64", "--load-format", "ipc_cache",
                                "--model-loader-extra-config", json.dumps(loader(sockets["checkpoint"])),
                                name="cache-fp8")
    online.wait_for_log("Weight cache daemon READY")
    return {"disk": disk, "cached": cached, "daemon": daemon, "online": online, "sockets": sockets}


def test_fp8_checkpoint_served_from_disk_and_cache_gives_transformers_greedy_tokens(served, transformers_reference):
    ref = transformers_reference
    assert "from disk" in served["disk"].log() and "Mapped " in served["cached"].log(), served["cached"].log()
    for engine in (served["disk"], served["cached"]):
        body = complete(engine.port, PROMPT, MAX_TOKENS)
        assert body["choices"][0]["token_ids"] == ref["greedy"], engine.args


def test_fp8_checkpoint_cache_tensors_are_the_disk_tensors_bit_for_bit(served, fp8_model, transformers_reference):
    socket_dir = served["sockets"]["checkpoint"]
    cfg, disk = load(fp8_model, "safetensors", socket_dir)
    _, cache = load(fp8_model, "ipc_cache", socket_dir)
    try:
        assert "weight cache" in cache.report.source and disk.report.source == "disk"
        d, c = disk.weights.tensors, cache.weights.tensors
        assert d.keys() == c.keys()
        assert all(same_bytes(d[n], c[n]) for n in d), [n for n in d if not same_bytes(d[n], c[n])]
        assert c["layers.0.attn.qkv.weight"].dtype == torch.float8_e4m3fn  # the daemon serves FP8 bytes
        assert cache.report.nbytes == disk.report.nbytes == disk.weights.nbytes
        ref = torch.tensor(transformers_reference["logits"])
        for loaded in (disk, cache):
            got = logits_of(cfg, loaded)
            assert (got.double() - ref.double()).abs().max() <= TOLERANCE * ref.abs().max()
    finally:
        cache.close()


def test_online_fp8_is_quantized_once_by_the_daemon_and_the_restart_skips_it(served, tiny_model):
    socket_dir = served["sockets"]["online"]
    times = {}
    for load_format in ("safetensors", "ipc_cache"):
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            cfg, loaded = load(tiny_model, load_format, socket_dir, "fp8")
            runs.append((time.perf_counter() - t0, loaded))
        times[load_format] = min(t for t, _ in runs)
        if load_format == "safetensors":
            disk = runs[0][1]
        else:
            cache = runs[0][1]
            for _, other in runs[1:]:
                other.close()
    try:
        assert "weight cache" in cache.report.source
        assert all(same_bytes(disk.weights.tensors[n], t) for n, t in cache.weights.tensors.items())
        assert cache.weights.tensors["layers.0.mlp.down.weight"].dtype == torch.float8_e4m3fn
        print(f"\n--quantization fp8 (tiny preset), weights ready: disk read + quantize "
              f"{times['safetensors'] * 1e3:.1f} ms, from the daemon {times['ipc_cache'] * 1e3:.1f} ms "
              f"({times['safetensors'] / times['ipc_cache']:.1f}x)")
        assert times["ipc_cache"] < times["safetensors"]
    finally:
        cache.close()


def test_an_engine_without_fp8_gets_the_field_level_mismatch_not_fp8_weights(served, tiny_model):
    with pytest.raises(WeightCacheError) as e:
        load(tiny_model, "ipc_cache", served["sockets"]["online"])
    assert "WeightCacheKey mismatch on fields: ['quantization', 'quantization_config']" in str(e.value)
    assert served["online"].proc.poll() is None  # the daemon keeps serving


def test_make_checkpoint_writes_fp8_and_refuses_a_block_size_without_it(main, tmp_path):
    code, out = main("make-checkpoint", str(tmp_path / "b16"), "--quantization", "fp8", "--weight-block-size", "16")
    assert code == 0, out
    qc = json.loads((tmp_path / "b16" / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"] == [16, 16] and qc["quant_method"] == "fp8"
    code, out = main("make-checkpoint", str(tmp_path / "plain"), "--weight-block-size", "16")
    assert code == 2 and "--weight-block-size applies to `wcache make-checkpoint --quantization fp8` only" in out
    assert not (tmp_path / "plain").exists()


def test_bench_times_online_fp8_through_the_daemon_and_every_engine(tiny_model, tmp_path):
    """`wcache bench -q fp8`: the daemon and every engine it starts quantize alike (else the cache
    key would differ and the cache samples fail); the record names the method."""
    from procs import private_env

    with private_env(tmp_path / "cache") as env:
        p = subprocess.run([sys.executable, "-m", "wcache.cli", "bench", "--model", str(tiny_model), "--device", "cpu",
                            "--quantization", "fp8", "--json", "--repeat", "1"], env=env, capture_output=True,
                           text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["model"]["quantization"]["quant_method"] == "fp8" and r["model"]["tensors"] == 43
    s = r["seconds"]
    print(f"\nwcache bench -q fp8 (tiny): disk read + quantize {s['disk'] * 1e3:.1f} ms, zero_copy "
          f"{s['zero_copy'] * 1e3:.1f} ms, copy {s['copy'] * 1e3:.1f} ms")
    assert s["zero_copy"] < s["disk"]
