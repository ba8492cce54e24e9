"""The reader's per-frame bounds on a real socket pair: descriptors counted over every segment of a
frame, one deadline for the whole frame from its first byte (the idle wait before it not counted),
the shape checks before and after parsing, and the byte budget across threads."""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import threading
import time

import pytest
from wcache.wire.protocol import (
    MAX_FDS,
    BudgetExceeded,
    FrameBudget,
    ProtocolError,
    recv_frame,
)


def frame(obj) -> bytes:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack(">Q", len(body)) + body


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_descriptors_are_counted_over_the_whole_frame_and_all_closed():
    a, b = socket.socketpair()
    spare = [os.open("/dev/null", os.O_RDONLY) for _ in range(MAX_FDS)]
    before = open_fds()
    data = frame({"v": 1, "op": "get_memory"})
    with a, b:
        for byte in data[:3]:  # 8 descriptors on each of 3 one-byte segments: 24 for one frame
            a.sendmsg([bytes([byte])], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", spare))])
        a.sendall(data[3:])
        with pytest.raises(ProtocolError, match=f"more than {MAX_FDS} file descriptors attached to a frame"):
            recv_frame(b)
    for fd in spare:
        os.close(fd)
    assert open_fds() <= before - MAX_FDS  # every received descriptor closed (and the pair)


def test_the_deadline_is_for_the_whole_frame_not_each_read():
    a, b = socket.socketpair()
    data = frame({"v": 1, "op": "get_memory", "pad": "x" * 50})
    stop = threading.Event()

    def trickle():
        for byte in data:
            if stop.wait(0.2):
                return
            try:
                a.sendall(bytes([byte]))
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    b.settimeout(5)  # each read would wait 5 s; the frame as a whole may take 1 s
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        recv_frame(b, timeout=1.0)
    assert time.monotonic() - t0 < 1.6
    assert b.gettimeout() == 5  # the socket's own timeout is given back
    stop.set()
    t.join(2)
    a.close(), b.close()


def test_the_wait_before_a_frame_is_not_part_of_its_deadline():
    a, b = socket.socketpair()
    b.settimeout(None)  # an idle lease waits as long as it likes
    threading.Timer(1.2, lambda: a.sendall(frame({"v": 1, "op": "get_memory"}))).start()
    assert recv_frame(b, timeout=1.0)[0]["op"] == "get_memory"
    a.close(), b.close()


@pytest.mark.parametrize("body, message", [
    (b'{"v":1,"x":[' + b"[]," * 70_000 + b"[]]}", "frame holds 70003 lists and objects; at most 65536 are allowed"),
    (b'{"v":1,"x":[' + b"0," * (1 << 20) + b"0]}", "elements; at most 1048576 are allowed"),
    (b'{"v":1,"x":' + b"[" * 40 + b"]" * 40 + b"}", "frame nests deeper than 32 levels"),
], ids=["containers", "elements", "nesting"])
def test_shape_bounds(body, message):
    a, b = socket.socketpair()
    with a, b:
        threading.Thread(target=a.sendall, args=(frame(body),), daemon=True).start()  # more than the buffer
        with pytest.raises(ProtocolError, match=message.replace("[", r"\[")):
            recv_frame(b)


def test_the_byte_budget_holds_large_frames_across_threads_and_lets_small_ones_pass():
    budget = FrameBudget(100, factor=1, small=10)
    budget.take(60)
    budget.take(5)  # small: not counted
    errors = []

    def other():
        try:
            budget.take(60)
        except BudgetExceeded as e:
            errors.append((e.held, e.limit))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors == [(60, 100)]
    budget.release()
    assert budget.held == 0
    budget.take(90)
    budget.release()
