"""Every way the cache can be unusable has its own reason text, with fallback on (log, then disk)
and off (wait for a starting daemon, or fail). Misbehaving daemons are real Unix socket servers
on threads here; the real daemon's reasons are in test_daemon.py and test_lifecycle.py."""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time

import pytest
from itest import fallback_reason  # the cfg fixture comes from conftest
from wcache.core.device import device_identity
from wcache.engine.loading.registry import load_weights
from wcache.errors import (
    REASONS,
    SocketSecurityError,
    WeightCacheError,
    WeightCacheTimeoutError,
)
from wcache.engine.loading.config import LoaderConfig
from wcache.wire.protocol import recv_frame, reply, send_frame
from wcache.wire.sockets import socket_name

ENGINE_ID = device_identity("cpu", 0)


class FakeDaemon:
    """A Unix socket server that answers every connection with ``behaviour(conn)``."""

    def __init__(self, path, behaviour):
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.behaviour = behaviour
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                try:
                    recv_frame(conn)  # the engine's get_state
                    self.behaviour(conn)
                except OSError:
                    pass

    def close(self):
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()


@pytest.fixture
def fake(tmp_path):
    made = []

    def start(behaviour):
        d = FakeDaemon(tmp_path / "fake.sock", behaviour)
        made.append(d)
        return d.path

    yield start
    for d in made:
        d.close()




def test_no_socket(cfg, caplog, wcache_env):
    expected = f"no daemon socket at {wcache_env['TMPDIR']}/wcache_{os.getuid()}/{socket_name(ENGINE_ID)}"
    assert fallback_reason(cfg, caplog) == expected


def test_refused_by_a_stale_socket_file(cfg, caplog, tmp_path):
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # the file stays, nobody listens: what a killed daemon leaves
    assert fallback_reason(cfg, caplog, socket_path=str(stale)) == (
        f"Cannot connect to weight cache daemon at {stale}: [Errno 111] Connection refused")


def test_protocol_error_from_a_daemon_answering_garbage(cfg, caplog, fake):
    path = fake(lambda conn: conn.sendall(struct.pack(">Q", 5) + b"hello"))
    assert fallback_reason(cfg, caplog, socket_path=str(path)) == (
        "protocol error from the weight cache daemon: frame is not valid JSON: Expecting value: line 1 column 1 (char 0)")


def test_protocol_error_from_a_daemon_of_another_protocol_version(cfg, caplog, fake):
    path = fake(lambda conn: send_frame(conn, {"v": 2, "ok": True}))
    assert fallback_reason(cfg, caplog, socket_path=str(path)) == (
        "protocol error from the weight cache daemon: protocol version 2 is not supported (this side speaks 1)")


def test_a_daemon_that_hangs_up_mid_handoff(cfg, caplog, fake):
    path = fake(lambda conn: None)
    if "lost" in REASONS:  # its own reason: the daemon died or stopped while answering
        expected = REASONS["lost"].format(path=path, error="peer closed the connection")
    else:
        expected = REASONS["protocol"].format(detail="peer closed the connection")
    assert fallback_reason(cfg, caplog, socket_path=str(path)) == expected


def test_protocol_error_from_an_ok_without_an_arena(cfg, caplog, fake):
    path = fake(lambda conn: send_frame(conn, reply(True, device_id=ENGINE_ID, arena={}, manifest={}, aliases={})))
    reason = fallback_reason(cfg, caplog, socket_path=str(path))
    assert reason.startswith("protocol error from the weight cache daemon: ")


def test_timeout_from_a_daemon_that_never_answers(cfg, caplog, fake):
    path = fake(lambda conn: time.sleep(3))
    t0 = time.monotonic()
    reason = fallback_reason(cfg, caplog, socket_path=str(path), state_timeout_s=0.5)
    assert reason == f"no reply from the weight cache daemon at {path} within 0.5s"
    assert time.monotonic() - t0 < 2.5


def test_device_mismatch(cfg, caplog, fake):
    path = fake(lambda conn: send_frame(conn, reply(True, device_id="GPU-1234", arena={}, manifest={})))
    assert fallback_reason(cfg, caplog, socket_path=str(path)) == (
        f"Daemon GPU GPU-1234 != engine GPU {ENGINE_ID}; check the socket path / GPU mapping")


def test_fallback_false_fails_at_once_on_a_reason_not_worth_waiting_for(cfg, fake):
    path = fake(lambda conn: conn.sendall(struct.pack(">Q", 2) + b"[]"))
    t0 = time.monotonic()
    with pytest.raises(WeightCacheError, match=r"^protocol error from the weight cache daemon: frame must be a JSON object, got list$"):
        load_weights(cfg, "ipc_cache", LoaderConfig(fallback=False, socket_path=str(path)))
    assert time.monotonic() - t0 < 2


def test_fallback_false_waits_for_the_daemon_then_fails(cfg, caplog, wcache_env):
    caplog.set_level(logging.INFO, "wcache.engine.loader")
    t0 = time.monotonic()
    with pytest.raises(WeightCacheTimeoutError) as err:
        load_weights(cfg, "ipc_cache", LoaderConfig(fallback=False, state_timeout_s=0.6))
    waited = time.monotonic() - t0
    path = f"{wcache_env['TMPDIR']}/wcache_{os.getuid()}/{socket_name(ENGINE_ID)}"
    assert str(err.value) == f"Weight cache daemon did not become ready within 0.6s: no daemon socket at {path}"
    assert "Waiting up to 0.6s for the weight cache daemon to start" in caplog.text
    assert 0.6 <= waited < 2


# -- the engine's side of the socket directory checks ---------------------------------------------

def test_engine_refuses_a_symlinked_socket_dir(cfg, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(SocketSecurityError, match=f"^Refusing to use symlinked socket directory {tmp_path}/link$"):
        load_weights(cfg, "ipc_cache", LoaderConfig(socket_dir=str(tmp_path / "link")))


def test_engine_refuses_an_open_default_socket_dir(cfg, wcache_env):
    d = f"{wcache_env['TMPDIR']}/wcache_{os.getuid()}"
    os.mkdir(d, 0o755)
    os.chmod(d, 0o755)
    with pytest.raises(SocketSecurityError, match=f"^Socket directory {d} is group/world accessible$"):
        load_weights(cfg, "ipc_cache", LoaderConfig())


def test_engine_refuses_a_socket_dir_of_another_user(cfg, tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to chown a directory to another uid")
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(SocketSecurityError, match=f"^Socket directory {d} is not owned by the current user$"):
        load_weights(cfg, "ipc_cache", LoaderConfig(socket_dir=str(d)))
