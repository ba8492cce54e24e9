"""Frames: length-prefixed JSON with passed descriptors; every bad frame is a ProtocolError and no
received descriptor survives it."""

from __future__ import annotations

import array
import json
import os
import socket
import struct

import pytest
from wcache.wire import protocol
from wcache.wire.protocol import (
    MAX_FDS,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    ProtocolError,
    recv_frame,
    send_frame,
)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def send_raw(sock: socket.socket, data: bytes, fds=()) -> None:
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(data)


def frame(body: bytes, length: int | None = None) -> bytes:
    return struct.pack(">Q", len(body) if length is None else length) + body


def test_frame_round_trip_with_descriptors():
    a, b = socket.socketpair()
    r, w = os.pipe()
    memfd = os.memfd_create("t")
    try:
        msg = protocol.request("get_state", key={"dtype": "bfloat16", "tp_size": 1}, mode="zero_copy", text="é")
        send_frame(a, msg, [r, memfd])
        got, fds = recv_frame(b)
        assert got == msg and got["v"] == PROTOCOL_VERSION
        assert len(fds) == 2 and not set(fds) & {r, memfd}  # new descriptors for the same files
        assert [os.fstat(fd).st_ino for fd in fds] == [os.fstat(r).st_ino, os.fstat(memfd).st_ino]
        os.write(w, b"x")
        assert os.read(fds[0], 1) == b"x"
        protocol.close_fds(fds)
        send_frame(a, protocol.reply(True, n=1))  # and a frame without descriptors after it
        assert recv_frame(b) == ({"v": PROTOCOL_VERSION, "ok": True, "n": 1}, [])
    finally:
        for fd in (r, w, memfd):
            os.close(fd)
        a.close(), b.close()


def test_large_frame_round_trips():
    a, b = socket.socketpair()
    a.settimeout(10), b.settimeout(10)
    entries = [{"name": f"layers.{i}.attn.qkv.weight", "dtype": "bfloat16", "shape": [128, 128],
                "stride": [128, 1], "offset": i * 32768} for i in range(10_000)]
    import threading

    t = threading.Thread(target=send_frame, args=(a, protocol.reply(True, tensors=entries)))
    t.start()
    got, _ = recv_frame(b)
    t.join()
    assert got["tensors"] == entries
    a.close(), b.close()


BAD_FRAMES = {
    "oversize": (struct.pack(">Q", MAX_FRAME_BYTES + 1), f"frame of {MAX_FRAME_BYTES + 1} bytes exceeds the maximum of {MAX_FRAME_BYTES}"),
    "truncated": (frame(b'{"v": 1}', length=100), "connection closed after 8 of 100 bytes"),
    "truncated_header": (b"\x00\x00\x00", "connection closed after 3 of 8 bytes"),
    "non_json": (frame(b"\x80\x04garbage"), "frame is not valid JSON"),
    "not_utf8_json": (frame(b"\xff\xfe{}"), "frame is not valid JSON"),
    "non_object": (frame(b"[1, 2, 3]"), "frame must be a JSON object, got list"),
    "wrong_version": (frame(json.dumps({"v": 2, "op": "get_memory"}).encode()),
                      f"protocol version 2 is not supported (this side speaks {PROTOCOL_VERSION})"),
    "no_version": (frame(b'{"op": "get_memory"}'), "protocol version None is not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_bad_frames_raise_and_close_received_descriptors(case):
    data, message = BAD_FRAMES[case]
    baseline = open_fds()
    a, b = socket.socketpair()
    r, w = os.pipe()
    send_raw(a, data, [r, w])
    os.close(r), os.close(w)  # from here only the copies in flight (then in the receiver) exist
    a.shutdown(socket.SHUT_WR)  # a truncated frame ends here
    with pytest.raises(ProtocolError) as err:
        recv_frame(b)
    assert message in str(err.value)
    a.close(), b.close()
    assert open_fds() == baseline, f"{case}: a received descriptor leaked"


def test_too_many_descriptors_is_refused_without_leaking():
    baseline = open_fds()
    a, b = socket.socketpair()
    pipes = [os.pipe() for _ in range(MAX_FDS)]
    fds = [fd for p in pipes for fd in p]  # 2 * MAX_FDS
    send_raw(a, frame(b'{"v": 1}'), fds)
    protocol.close_fds(fds)
    with pytest.raises(ProtocolError, match=f"more than {MAX_FDS} file descriptors attached to a frame"):
        recv_frame(b)
    a.close(), b.close()
    assert open_fds() == baseline


def test_clean_close_is_eof_not_a_protocol_error():
    a, b = socket.socketpair()
    a.close()
    with pytest.raises(EOFError):
        recv_frame(b)
    b.close()


def test_a_smaller_reader_limit_is_enforced():
    a, b = socket.socketpair()
    send_frame(a, {"v": 1, "pad": "x" * 100})
    with pytest.raises(ProtocolError, match="exceeds the maximum of 64"):
        recv_frame(b, max_bytes=64)
    a.close(), b.close()


def test_encode_refuses_an_oversize_frame():
    with pytest.raises(ProtocolError, match=f"exceeds the maximum of {MAX_FRAME_BYTES}"):
        protocol.encode({"v": 1, "pad": "x" * MAX_FRAME_BYTES})


def test_requests_are_the_three_upstream_ones():
    assert protocol.REQUESTS == ("get_state", "get_memory", "release")
    assert protocol.request("release") == {"v": PROTOCOL_VERSION, "op": "release"}
