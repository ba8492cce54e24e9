"""Hand-back attacks mounted through the socket directory only, each by a real process of the daemon's
user (handback_attacker.py) that was served the genuine arena like any zero_copy engine: a forged
description of a genuine arena, the previous checkpoint's arena replayed after an update, and an
arena packed for another dtype. After each, new engines must answer exactly as a disk load does.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from faultlib import call
from procs import complete
from wcache.core.checkpoint import make_checkpoint
from wcache.core.config import EngineConfig
from wcache.core.device import device_identity
from wcache.core.fingerprint import cache_key
from wcache.errors import ADOPTED, ARENA_NOT_RECORDED, OFFER_SKIPPED, RECORD_NOT_USABLE
from wcache.wire.sockets import socket_name

NO_TUNE = "--no-enable-autotune"
LOADED = "Rank 0 loaded "
SOCK_NAME = socket_name(device_identity("cpu", 0))
ATTACKER = Path(__file__).with_name("handback_attacker.py")
PROMPT = "the weights are"

pytestmark = pytest.mark.slow  # daemons, engines and an attacker process per test: tens of seconds


class Attacker:
    """handback_attacker.py as its own process: holds the genuine arena, plants forged offers."""

    def __init__(self, sock: Path, key: dict, env: dict):
        self.proc = subprocess.Popen([sys.executable, str(ATTACKER), str(sock), json.dumps(key)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        assert line[:1] == ["HELD"], line
        self.arena_id = line[1]

    def offer(self, **forged) -> Path:
        self.proc.stdin.write(json.dumps(forged) + "\n")
        self.proc.stdin.flush()
        kind, path = self.proc.stdout.readline().split()
        assert kind == "OFFERED"
        return Path(path)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait(10)


def setup(fault_procs, fault_env, model: Path, dtype: str = "auto"):
    """A daemon's socket directory, its flags (the first daemon's dtype aside), and an attacker that
    was served the first daemon's arena and outlives it."""
    d = Path(tempfile.mkdtemp(prefix="hba-"))
    flags = (NO_TUNE, "--weight-cache-socket-dir", str(d))
    cfg = EngineConfig.build(str(model), dtype, None, "cpu")
    first = fault_procs.preload(model, *flags, "--dtype", dtype)
    attacker = Attacker(d / SOCK_NAME, cache_key(cfg), fault_env)
    first.stop()  # the attacker keeps the arena alive, as a running engine would
    return d, flags, attacker


def answers_as_disk(fault_procs, model: Path, d: Path) -> str:
    """Tokens of a new zero_copy engine of the daemon against an engine that loads from disk: equal."""
    engine = fault_procs.serve(model, "--load-format", "ipc_cache", NO_TUNE, "--model-loader-extra-config",
                               json.dumps({"socket_dir": str(d), "fallback": False}))
    disk = fault_procs.serve(model, NO_TUNE)
    try:
        served = complete(engine.port, PROMPT)["choices"][0]["text"]
        assert served == complete(disk.port, PROMPT)["choices"][0]["text"]
        return served
    finally:
        engine.stop()
        disk.stop()


def test_a_genuine_arena_with_a_forged_layout_aliases_and_attrs_is_served_as_packed(fault_procs, fault_env,
                                                                                     tiny_model):
    d, flags, attacker = setup(fault_procs, fault_env, tiny_model)
    try:
        groups = json.loads(json.dumps(_manifest_of(tiny_model)))["groups"]
        for g in groups:  # every layer's tensor where another layer's was
            g["names"] = g["names"][::-1]
        attacker.offer(manifest={"groups": groups}, aliases={"lm_head.weight": "embed.weight"},
                               attrs={"quant_method": "none", "layers": [0, 4], "forged": True})
        second = fault_procs.preload(tiny_model, *flags)
        log = second.log()
        assert ADOPTED.split(" (pid")[0].format(rank=0) in log and LOADED not in log, log  # the genuine bytes
        # Served as this daemon packed them, whatever the offer said about them.
        key = cache_key(EngineConfig.build(str(tiny_model), "auto", None, "cpu"))
        got = call(d / SOCK_NAME, "get_state", key=key, mode="copy")
        assert got["manifest"] == _manifest_of(tiny_model) and got["aliases"] == {}
        assert got["attrs"] == {"quant_method": "none", "layers": [0, 4],
                                "quantization_config": {"quant_method": "none"}}  # as packed, not as forged
        answers_as_disk(fault_procs, tiny_model, d)
    finally:
        attacker.close()


def _manifest_of(model: Path) -> dict:
    """The manifest a daemon packs for this model on the CPU (the layout is a function of the weights)."""
    from wcache.core.disk import load_processed
    from wcache.wire.arena import manifest, plan_layout
    from wcache.wire.transports.memfd import ALIGN

    weights = load_processed(EngineConfig.build(str(model), "auto", None, "cpu"), False)
    return manifest(plan_layout(weights.tensors, ALIGN))


def test_the_previous_checkpoints_arena_is_not_adopted_after_an_update(fault_procs, fault_env, tmp_path):
    model = make_checkpoint(tmp_path / "model", "tiny", seed=3)
    d, flags, attacker = setup(fault_procs, fault_env, model)
    try:
        updated = make_checkpoint(tmp_path / "update", "tiny", seed=11)
        for f in updated.iterdir():  # the update lands in place, as a new revision synced over the old
            shutil.copy2(f, model / f.name)
        new_key = cache_key(EngineConfig.build(str(model), "auto", None, "cpu"))
        offer = attacker.offer(key=new_key)  # the old weights, claimed under the new checkpoint's key
        second = fault_procs.preload(model, *flags)
        log = second.log()
        assert RECORD_NOT_USABLE.format(rank=0, why="its record is of an arena packed for other weights "
                                                    "(cache key fields differ: ['checkpoint'])") in log, log
        assert "adopted the arena" not in log and LOADED in log
        answers_as_disk(fault_procs, model, d)

        # The daemon that loaded the update recorded its own arena: the old one is refused again.
        second.stop()
        third = fault_procs.preload(model, *flags)
        assert OFFER_SKIPPED.format(rank=0, offer=offer, why=ARENA_NOT_RECORDED) in third.log(), third.log()
        assert "adopted the arena" not in third.log() and LOADED in third.log()
        answers_as_disk(fault_procs, model, d)
    finally:
        attacker.close()


def test_an_arena_packed_for_another_dtype_is_not_adopted(fault_procs, fault_env, tiny_model):
    d, flags, attacker = setup(fault_procs, fault_env, tiny_model, "float32")
    try:
        key = cache_key(EngineConfig.build(str(tiny_model), "auto", None, "cpu"))
        offer = attacker.offer(key=key)  # float32 bytes claimed as the bfloat16 daemon's
        second = fault_procs.preload(tiny_model, *flags)
        log = second.log()
        assert RECORD_NOT_USABLE.format(rank=0, why="its record is of an arena packed for other weights "
                                                    "(cache key fields differ: ['dtype'])") in log, log
        assert "adopted the arena" not in log and LOADED in log
        # Restarted again, the record is now of the bfloat16 arena: the float32 one (twice its size,
        # whatever layout the offer claims) is not it.
        second.stop()
        third = fault_procs.preload(tiny_model, *flags)
        assert OFFER_SKIPPED.format(rank=0, offer=offer, why="the handed-back memfd holds ") in third.log(), third.log()
        assert "adopted the arena" not in third.log()
        answers_as_disk(fault_procs, tiny_model, d)
    finally:
        attacker.close()
