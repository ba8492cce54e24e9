"""One `wcache preload` daemon for the module: readiness, health, permissions, the protocol against
bad peers, zero_copy engines, key mismatch, unsafe sockets, the lock and SO_PEERCRED."""

from __future__ import annotations

import array
import json
import logging
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from itest import call, default_socket, rank_pids, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from procs import free_port, http
from wcache.core.config import EngineConfig
from wcache.core.disk import load_processed
from wcache.engine.loading.registry import load_weights
from wcache.errors import WeightCacheError
from wcache.engine.loading.config import LoaderConfig
from wcache.model.llama import bind_weights, build_meta_model, generate
from wcache.wire.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION

PROMPT = [256, *b"The weight cache"]


@pytest.fixture(scope="module")
def health_port():
    return free_port()


@pytest.fixture(scope="module")
def daemon(module_procs, tiny_model, health_port):
    return module_procs.preload(tiny_model, "--weight-cache-health-port", str(health_port),
                                "--weight-cache-health-host", "127.0.0.1")


@pytest.fixture(scope="module")
def sock(daemon, module_env):
    return default_socket(module_env)


def forward(model_dir, lc=None, load_format="ipc_cache", dtype="auto", quantization=None):
    """Load like the engine does, bind, and run: (logits, greedy ids, report, lease)."""
    cfg = EngineConfig.build(str(model_dir), dtype, quantization, "cpu")
    weights, report, lease = load_weights(cfg, load_format, lc)
    model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), weights.bindable())
    logits = model(torch.tensor(PROMPT), 0, model.new_cache(len(PROMPT)))
    ids = generate(model, PROMPT, 8)
    return logits, ids, report, lease


def close(lease) -> None:
    if lease is not None:
        lease.close()


def exchange(path, data: bytes, fds=()) -> tuple[dict | None, bool]:
    """Send raw bytes; return (reply or None, whether the daemon then closed the connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        if fds:
            s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        buf = b""
        try:
            while chunk := s.recv(65536):
                buf += chunk
        except ConnectionResetError:  # the daemon closed with bytes of ours unread
            return None, True
    if len(buf) < 8:
        return None, True
    (n,) = struct.unpack(">Q", buf[:8])
    return json.loads(buf[8 : 8 + n]), True


def frame(obj) -> bytes:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack(">Q", len(body)) + body


def assert_serving(sock) -> None:
    answer = call(sock, "get_memory")
    assert answer["ok"] and answer["weights_bytes"] > 0 and answer["released"] is False


def test_ready_line_and_health(daemon, sock, health_port):
    assert "Weight cache daemon READY (1 rank(s) in " in daemon.log() and str(sock) in daemon.log()
    assert http("GET", f"http://127.0.0.1:{health_port}/health") == (200, {"status": "ready"})


def test_the_launcher_maps_no_torch_and_its_rank_does(daemon):
    # The launcher only plans and starts ranks: importing torch there cost every replica of a
    # fan-out about 2 s of CPU on a 2-core host (docs/benchmarks.md, weight seeding). Its maps, once
    # READY, show whether torch was ever loaded (a shared library is never unloaded).
    assert "libtorch" not in Path(f"/proc/{daemon.pid}/maps").read_text()
    assert all("libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in rank_pids(daemon.pid))


def test_socket_is_0600_in_a_private_0700_dir(sock):
    d = os.lstat(sock.parent)
    s = os.lstat(sock)
    assert sock.parent.name == f"wcache_{os.getuid()}"
    assert stat.S_ISDIR(d.st_mode) and stat.S_IMODE(d.st_mode) == 0o700 and d.st_uid == os.getuid()
    assert stat.S_ISSOCK(s.st_mode) and stat.S_IMODE(s.st_mode) == 0o600 and s.st_uid == os.getuid()
    assert sock.name.startswith("wcache_weight_cache_cpu-") and sock.name.endswith("-0.sock")
    assert os.path.exists(f"{sock}.lock")


def test_get_memory_reports_the_post_processed_weights(sock, tiny_model):
    expected = load_processed(EngineConfig.build(str(tiny_model), "auto", None, "cpu"), show_progress=False).nbytes
    answer = call(sock, "get_memory")
    assert answer["v"] == PROTOCOL_VERSION and answer["ok"] is True
    assert answer["weights_bytes"] == expected and answer["arena_bytes"] >= expected
    assert answer["released"] is False and answer["zero_copy_engines"] == 0


BAD = {
    "not json": (frame(b"\x80\x05garbage"), "frame is not valid JSON"),
    "not an object": (frame([1, 2]), "frame must be a JSON object, got list"),
    "wrong version": (frame({"v": 99, "op": "get_memory"}), "protocol version 99 is not supported (this side speaks 1)"),
    "unknown op": (frame({"v": 1, "op": "bogus"}), "unknown request 'bogus'; expected get_state, get_memory or release"),
    "get_state without a key": (frame({"v": 1, "op": "get_state"}),
                                "get_state needs a key object and a mode of ['zero_copy', 'copy']"),
    "get_state with a bad mode": (frame({"v": 1, "op": "get_state", "key": {}, "mode": "steal"}),
                                  "get_state needs a key object and a mode of ['zero_copy', 'copy']"),
    # The body the daemon refuses to read is still in flight: the answer must reach us anyway.
    "oversize": (struct.pack(">Q", MAX_FRAME_BYTES + 1) + b"x" * 65536,
                 f"frame of {MAX_FRAME_BYTES + 1} bytes exceeds the maximum"),
    "trailing bytes after a bad frame": (frame(b"") + b"\x00" * 100, "frame is not valid JSON"),
    "truncated": (struct.pack(">Q", 1000) + b"{}", "connection closed after 2 of 1000 bytes"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_frame_gets_a_protocol_error_and_the_daemon_keeps_serving(daemon, sock, case):
    data, message = BAD[case]
    answer, closed = exchange(sock, data)
    assert answer["ok"] is False and answer["error"] == "protocol", answer
    assert message in answer["message"]
    assert closed
    assert_serving(sock)


def test_descriptors_sent_to_the_daemon_are_closed(daemon, sock):
    [rank] = rank_pids(daemon.pid)

    def count() -> int:
        return len(os.listdir(f"/proc/{rank}/fd"))

    time.sleep(0.3)  # connections of earlier tests finish closing on the daemon's threads
    before = count()
    r, w = os.pipe()
    try:
        answer, _ = exchange(sock, frame({"v": 1, "op": "get_memory"}), [r, w])
    finally:
        os.close(r), os.close(w)
    assert answer["ok"] is True
    wait_until(lambda: count() <= before, 5, f"the daemon's descriptors to return to {before}")


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.one_of(st.binary(max_size=64),
                      st.binary(max_size=48).map(lambda b: struct.pack(">Q", len(b)) + b),
                      st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.integers(), st.text(max_size=8)),
                                      max_size=4).map(lambda d: frame({"v": 1, **d}))))
def test_fuzzed_frames_never_take_the_daemon_down(daemon, sock, data):
    answer, _ = exchange(sock, data)
    assert answer is None or answer["v"] == PROTOCOL_VERSION
    if answer is not None and answer.get("ok"):
        assert "weights_bytes" in answer  # only a well-formed get_memory can succeed
    assert daemon.proc.poll() is None


def test_zero_copy_engine_is_bit_identical_to_disk_and_holds_a_lease(daemon, sock, tiny_model, caplog):
    caplog.set_level(logging.INFO, "wcache.engine.loader")
    disk_logits, disk_ids, disk, _lease = forward(tiny_model, load_format="safetensors")
    logits, ids, report, lease = forward(tiny_model, LoaderConfig(fallback=False))
    try:
        assert "Mapped 27 tensors from the weight cache daemon (zero_copy mode)" in caplog.text
        assert report.source == "the weight cache (zero_copy)" and report.fallback_reason is None
        assert report.external_bytes == report.nbytes == disk.nbytes
        assert torch.equal(logits, disk_logits) and ids == disk_ids
        assert call(sock, "get_memory")["zero_copy_engines"] == 1
    finally:
        close(lease)
    # The daemon sees the closed connection on its own thread, a moment after close() returns.
    wait_until(lambda: call(sock, "get_memory")["zero_copy_engines"] == 0, 10, "the closed lease to end")


def test_key_mismatch_falls_back_with_the_differing_fields(daemon, sock, tiny_model, caplog):
    caplog.set_level(logging.INFO, "wcache.engine.loader")
    _, _, report, _lease = forward(tiny_model, LoaderConfig(), dtype="float32")
    assert report.source == "disk" and report.fallback_reason == "WeightCacheKey mismatch on fields: ['dtype']"
    assert ("Weight cache unusable (WeightCacheKey mismatch on fields: ['dtype']); falling back to disk loading"
            in caplog.text)
    _, _, report, _lease = forward(tiny_model, LoaderConfig(), quantization="int8")
    assert report.fallback_reason == "WeightCacheKey mismatch on fields: ['quantization', 'quantization_config']"
    with pytest.raises(WeightCacheError, match=r"^WeightCacheKey mismatch on fields: \['dtype'\]$"):
        forward(tiny_model, LoaderConfig(fallback=False), dtype="float32")  # not worth waiting for
    assert_serving(sock)


def test_a_symlinked_or_foreign_socket_path_is_refused(daemon, sock, tiny_model, tmp_path, caplog):
    caplog.set_level(logging.INFO, "wcache.engine.loader")
    link = tmp_path / "link.sock"
    link.symlink_to(sock)
    _, _, report, _lease = forward(tiny_model, LoaderConfig(socket_path=str(link)))
    assert report.source == "disk"
    assert report.fallback_reason == f"Weight cache socket {link} is unavailable: {link} is a symlink"
    assert f"Weight cache unusable ({report.fallback_reason}); falling back to disk loading" in caplog.text
    plain = tmp_path / "plain.sock"
    plain.write_text("")
    _, _, report, _lease = forward(tiny_model, LoaderConfig(socket_path=str(plain)))
    assert report.fallback_reason == f"Weight cache socket {plain} is unavailable: {plain} is not a socket"


def test_a_second_daemon_for_the_same_socket_fails_with_exit_2(daemon, sock, module_procs, tiny_model):
    second = module_procs.preload(tiny_model, ready=False, name="second-daemon")
    assert second.exit_code(120) == 2
    log = second.log()
    assert f"Another weight cache daemon already owns {sock}" in log
    assert "exited during startup" not in log  # the launcher stopped on the lock: it started no rank
    assert_serving(sock)


PEER_CLIENT = r"""
import json, os, socket, struct, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
body = json.dumps({"v": 1, "op": "get_memory"}).encode()
s.sendall(struct.pack(">Q", len(body)) + body)
buf = b""
while chunk := s.recv(65536):
    buf += chunk
print(os.getuid(), buf[8:].decode())
"""


def test_a_client_of_another_uid_is_rejected(daemon, sock, module_env):
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as uid 65534 (setpriv)")
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is not installed")
    # Let uid 65534 reach the socket for this test only, so the daemon's uid check is what refuses.
    paths = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in (sock.parent.parent, sock.parent, sock)}
    try:
        for p in paths:
            os.chmod(p, 0o777 if p == sock else 0o711)
        out = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                              sys.executable, "-I", "-c", PEER_CLIENT, str(sock)],
                             check=False, capture_output=True, text=True, timeout=60)
    finally:
        for p, mode in paths.items():
            os.chmod(p, mode)
    assert out.returncode == 0, out.stderr
    uid, answer = out.stdout.split(" ", 1)
    assert uid == "65534"
    assert json.loads(answer) == {"v": 1, "ok": False, "error": "rejected",
                                  "message": "Rejecting weight cache connection from uid 65534"}
    assert "Rejecting weight cache connection from uid 65534" in daemon.log()
    assert_serving(sock)
