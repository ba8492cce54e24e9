"""Socket paths never outgrow a Unix socket address because of TMPDIR's depth or a device's identity:
a name that would not fit becomes a short digest, the same on the daemon's side and the engine's."""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from dataclasses import asdict

from wcache.core.config import EngineConfig
from wcache.core.ranks import Ranks
from wcache.daemon.rank import RankDaemon
from wcache.engine.loading.config import LoaderConfig
from wcache.engine.loading.ipc_cache import resolve_socket_path
from wcache.wire.sockets import MAX_SOCKET_PATH, bind_private_socket, short_private_dir, socket_name, socket_path_for

GPU_ID = f"GPU-{uuid.uuid4()}"  # what a CUDA device's identity looks like: 40 bytes


def test_a_path_that_fits_keeps_the_device_in_its_name(tmp_path):
    assert socket_path_for(tmp_path, "cpu-abc-0") == tmp_path / socket_name("cpu-abc-0")


def test_a_gpu_socket_under_a_deep_directory_is_short_and_binds():
    base = short_private_dir("wcache-t-")
    deep = base / ("d" * (68 - len(os.fsencode(base))))  # 69 bytes: the device's own name cannot fit
    deep.mkdir()
    try:
        _binds_a_short_socket(deep)
    finally:
        shutil.rmtree(base)


def _binds_a_short_socket(deep):
    assert len(os.fsencode(deep / socket_name(GPU_ID))) > MAX_SOCKET_PATH
    path = socket_path_for(deep, GPU_ID)
    assert path.parent == deep and len(os.fsencode(path)) <= MAX_SOCKET_PATH
    # The same device gets the same name each time; its draft daemon and other devices others.
    assert path == socket_path_for(deep, GPU_ID)
    others = {socket_path_for(deep, GPU_ID, draft=True), socket_path_for(deep, f"GPU-{uuid.uuid4()}")}
    assert path not in others and len(others) == 2
    listener = bind_private_socket(path)
    listener.listen(1)
    with listener, socket.socket(socket.AF_UNIX) as client:
        client.connect(str(path))


def test_the_daemon_and_the_engine_agree_on_a_shortened_path(tiny_model, tmp_path):
    deep = tmp_path / ("d" * 120)
    spec = {"ranks": asdict(Ranks()), "model": str(tiny_model), "dtype": "auto", "quantization": None,
            "device": "cpu", "socket_dir": str(deep)}
    daemon_side = RankDaemon(spec).socket_path
    cfg = EngineConfig.build(str(tiny_model), "auto", None, "cpu")
    assert resolve_socket_path(cfg, LoaderConfig(socket_dir=str(deep))) == daemon_side
    assert daemon_side.name != socket_name(RankDaemon(spec).device_id)


def test_a_short_private_dir_is_short_and_private_whatever_tmpdir_is(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 200)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    d = short_private_dir("wcache-t-")
    try:
        assert len(os.fsencode(d)) < 40 and os.stat(d).st_mode & 0o777 == 0o700 and os.stat(d).st_uid == os.getuid()
    finally:
        d.rmdir()
