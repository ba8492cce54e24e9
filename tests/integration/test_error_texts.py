"""Messages the troubleshooting page quotes that no other test produced, each triggered for real.

The daemon stand-in below is a real Unix socket server that answers one ``get_state`` the way a
daemon would, with whatever arena it is given: the cases here are ones a CPU-only machine's real
daemon cannot produce (a GPU transport, memory the kernel refuses to map).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import asdict

import pytest
from itest import fallback_reason  # the cfg fixture comes from conftest
from wcache.core.config import Ranks
from wcache.daemon.rank import MAX_SOCKET_PATH, SOCKET_PATH_TOO_LONG, RankDaemon
from wcache.core.device import device_identity
from wcache.engine.loading.registry import load_weights
from wcache.errors import UnsupportedPlatformForIPCError, UserError
from wcache.engine.loading.config import LoaderConfig
from wcache.wire.protocol import recv_frame, reply, send_frame
from wcache.wire.sockets import socket_path_for

ENGINE_ID = device_identity("cpu", 0)


@pytest.fixture
def answer_once(tmp_path):
    """Start a one-shot daemon stand-in; returns its socket path."""
    servers = []

    def start(arena: dict, fds: list[int] = ()) -> str:
        path = tmp_path / "stand-in.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(1)

        def serve():
            conn, _ = listener.accept()
            with conn:
                recv_frame(conn)  # the engine's get_state
                send_frame(conn, reply(True, device_id=ENGINE_ID, arena=arena, manifest={"groups": []},
                                       aliases={}, attrs={}, weights_bytes=0), list(fds))

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        servers.append((listener, thread))
        return str(path)

    yield start
    for listener, thread in servers:
        thread.join(timeout=5)
        listener.close()




def test_memory_the_kernel_refuses_to_map_is_named(cfg, caplog, answer_once, tmp_path):
    # A descriptor of the arena's size that cannot be mapped for reading: opened write-only.
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(4096))
    fd = os.open(arena, os.O_WRONLY)
    try:
        path = answer_once({"kind": "memfd", "size": 4096}, [fd])
        reason = fallback_reason(cfg, caplog, socket_path=path)
    finally:
        os.close(fd)
    assert reason == "Cannot map the weight cache daemon's memory: [Errno 13] Permission denied"


def test_a_transport_other_than_the_loaders_is_named(cfg, caplog, answer_once):
    path = answer_once({"kind": "vmm_fd", "size": 4096})
    reason = fallback_reason(cfg, caplog, socket_path=path, transport="cuda_ipc")
    assert reason == "The weight cache daemon serves a vmm_fd arena but the loader requires transport cuda_ipc"


def test_a_socket_dir_too_long_for_a_unix_socket_is_refused_before_binding(tiny_model, tmp_path):
    long_dir = tmp_path / ("d" * 100)
    spec = {"ranks": asdict(Ranks()), "model": str(tiny_model), "dtype": "auto", "quantization": None,
            "device": "cpu", "socket_dir": str(long_dir)}
    daemon = RankDaemon(spec)
    with pytest.raises(UserError) as err:
        daemon.claim()
    path = socket_path_for(long_dir, daemon.device_id)  # even the short name cannot fit
    assert len(os.fsencode(path)) > MAX_SOCKET_PATH
    assert str(err.value) == (f"Socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow at most "
                              "107. Use a shorter --weight-cache-socket-dir")
    assert str(err.value) == SOCKET_PATH_TOO_LONG.format(path=path, n=len(os.fsencode(path)), max=MAX_SOCKET_PATH)
    assert not list(long_dir.iterdir())  # no socket and no lock file were made


def test_ipc_cache_on_another_platform_is_an_error_even_with_fallback(cfg, monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")  # there is no macOS here to run it on
    with pytest.raises(UnsupportedPlatformForIPCError) as err:
        load_weights(cfg, "ipc_cache", LoaderConfig(fallback=True))
    assert str(err.value) == ("UnsupportedPlatformForIPCError: the weight cache needs Linux (memfd or CUDA IPC); "
                              "this is darwin")
