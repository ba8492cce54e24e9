"""Bit-identical outputs from disk, zero_copy and copy, for tied embeddings and for int8 weights
(the untied bf16 model is covered in test_daemon.py and test_lifecycle.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from itest import call, wait_until
from procs import READY
from wcache.core.config import EngineConfig
from wcache.core.device import device_identity
from wcache.engine.loading.registry import load_weights
from wcache.engine.loading.config import LoaderConfig
from wcache.model.llama import bind_weights, build_meta_model, generate
from wcache.wire.sockets import socket_name

PROMPT = [256, *b"Tied or not"]


@pytest.fixture(scope="module")
def daemons(module_procs, module_env, tiny_tied_model, tiny_model):
    """Two daemons, each in its own socket directory, started side by side."""
    base = Path(module_env["TMPDIR"])
    variants = {"tied": (tiny_tied_model, None), "int8": (tiny_model, "int8")}
    started = {}
    for name, (model, quant) in variants.items():
        flags = ["--weight-cache-socket-dir", str(base / name)] + (["-q", quant] if quant else [])
        started[name] = module_procs.preload(model, *flags, ready=False, name=f"daemon-{name}")
    for p in started.values():
        p.wait_for_log(READY)
    return {name: (variants[name][0], variants[name][1], base / name) for name in variants}


def run(model_dir, quantization, load_format, lc=None):
    cfg = EngineConfig.build(str(model_dir), "auto", quantization, "cpu")
    weights, report, lease = load_weights(cfg, load_format, lc)
    model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), weights.bindable())
    logits = model(torch.tensor(PROMPT), 0, model.new_cache(len(PROMPT)))
    return logits, generate(model, PROMPT, 8), weights, report, lease


@pytest.mark.parametrize("variant", ["tied", "int8"])
def test_disk_zero_copy_and_copy_are_bit_identical(daemons, variant, caplog):
    caplog.set_level(logging.INFO, "wcache.engine.loader")
    model_dir, quant, socket_dir = daemons[variant]
    sock = socket_dir / socket_name(device_identity("cpu", 0))

    disk_logits, disk_ids, _, _, _ = run(model_dir, quant, "safetensors")
    lc = {"fallback": False, "socket_dir": str(socket_dir)}
    zero_logits, zero_ids, weights, report, lease = run(model_dir, quant, "ipc_cache", LoaderConfig(**lc))
    try:
        assert report.source == "the weight cache (zero_copy)"
        # What the daemon sent (the manifest as the engine decoded it): tied weights once plus an
        # alias bound to the same memory; int8 projections as int8 with float32 scales.
        sent = weights.tensors
        if variant == "tied":
            assert "lm_head.weight" not in sent and len(sent) == 26
            assert weights.aliases == {"lm_head.weight": "embed.weight"}
            bound = weights.bindable()
            assert bound["lm_head.weight"].data_ptr() == bound["embed.weight"].data_ptr()
        else:
            assert sent["layers.0.attn.qkv.qweight"].dtype == torch.int8
            assert sent["layers.0.attn.qkv.scale"].dtype == torch.float32
            assert "layers.0.attn.qkv.weight" not in sent and len(sent) == 3 + 4 * (2 + 4 * 2)
        n = len(sent)
    finally:
        lease.close()
    # The daemon drops the lease when it sees the connection close; until then it refuses a release.
    wait_until(lambda: call(sock, "get_memory")["zero_copy_engines"] == 0, 10, "the zero_copy lease to end")
    copy_logits, copy_ids, _, report, _ = run(model_dir, quant, "ipc_cache", LoaderConfig(mode="copy", **lc))
    assert report.source == "the weight cache (copy)"
    assert f"Mapped {n} tensors from the weight cache daemon (zero_copy mode)" in caplog.text
    assert f"Mapped {n} tensors from the weight cache daemon (copy mode)" in caplog.text

    assert torch.equal(zero_logits, disk_logits) and torch.equal(copy_logits, disk_logits)
    assert zero_ids == disk_ids == copy_ids
    assert call(sock, "get_memory")["released"] is True
