"""The ``--respawn`` handoff's pieces without processes: frames with a descriptor over a real Unix
socket pair (engine/respawn/handoff.py), and when the supervisor has read a whole request
(engine/respawn/reception.py's ``request_complete``)."""

from __future__ import annotations

import os
import socket
import sys

from wcache.engine.respawn import handoff
from wcache.engine.respawn.reception import MAX_HEAD, request_complete

MAX_BODY = 1 << 20


def test_a_frame_carries_json_bytes_and_a_working_descriptor():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    body = bytes(range(256)) * 100  # binary; small enough to sit in the socket buffer unread
    try:
        handoff.send(ours, {"id": 7, "data": handoff.encode(body)}, fd=r)
        handoff.send(ours, {"id": 8, "event": "done"})
        frame, fd = handoff.recv(theirs)
        assert frame["id"] == 7 and handoff.decode(frame["data"]) == body
        assert fd is not None and fd != r
        os.write(w, b"x")
        assert os.read(fd, 1) == b"x"  # the same pipe, through the passed descriptor
        os.close(fd)
        frame, fd = handoff.recv(theirs)
        assert frame == {"id": 8, "event": "done"} and fd is None
        ours.close()
        try:
            handoff.recv(theirs)
        except handoff.ChannelClosed:
            pass
        else:
            raise AssertionError("a closed channel must say so")
    finally:
        for s in (ours, theirs):
            s.close()
        os.close(r)
        os.close(w)


def test_the_frame_reader_splits_frames_that_arrive_in_pieces():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(False)
    reader = handoff.FrameReader(theirs)
    try:
        handoff.send(ours, {"id": 1, "event": "begun", "stream": True})
        handoff.send(ours, {"id": 1, "event": "done", "keep": False})
        assert [f["event"] for f in reader.read()] == ["begun", "done"]
        assert reader.read() == [] and not reader.eof
        ours.close()
        reader.read()
        assert reader.eof
    finally:
        ours.close()
        theirs.close()


def test_a_request_is_complete_with_its_whole_body_or_when_the_worker_must_refuse_it():
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
    assert not request_complete(b"GET /health HTTP/1.1\r\nHost: x\r\n", MAX_BODY)  # head not ended
    assert request_complete(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", MAX_BODY)
    assert not request_complete(head + b"12345", MAX_BODY)
    assert request_complete(head + b"1234567890", MAX_BODY)
    # What the worker's front door refuses at once is handed over without waiting for more:
    assert request_complete(head.replace(b"10", b"%d" % (MAX_BODY + 1)), MAX_BODY)  # 413
    assert request_complete(b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", MAX_BODY)
    assert request_complete(b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n", MAX_BODY)
    assert request_complete(b"POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n", MAX_BODY)  # 400
    assert request_complete(b"GET /" + b"a" * (MAX_HEAD + 1), MAX_BODY)  # an over-long head


def test_the_supervisor_side_imports_no_torch():
    import subprocess

    code = ("import sys, wcache.engine.respawn.respawn, wcache.engine.respawn.reception, wcache.engine.respawn.handoff; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_worker_that_breaks_the_protocol_is_caught_and_not_read_again():
    # What a lying worker (a bug, or a process that is no longer the engine) can put on its channel:
    # each is a BadFrame, which the supervisor answers by killing that worker (engine/respawn/respawn.py).
    import struct

    import pytest

    from wcache.engine.respawn.reception import Reception

    sends = [struct.pack(">I", handoff.MAX_FRAME + 1), struct.pack(">I", 5) + b"{nope",
             struct.pack(">I", 4) + b"[12]", struct.pack(">I", 2) + b"\xff\xfe"]
    for raw in sends:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.setblocking(False)
        reader = handoff.FrameReader(theirs)
        try:
            ours.sendall(raw + struct.pack(">I", 2) + b"{}")
            with pytest.raises(handoff.BadFrame):
                reader.read()
            assert reader.eof and reader.read() == []  # nothing more is read from it
        finally:
            ours.close()
            theirs.close()
    listener = socket.socket()
    try:
        reception = Reception(listener, {"max_body": MAX_BODY}, {})
        for frame in ({"id": "1", "event": "begun"}, {"id": 1, "event": "launch"}, {"event": "done"},
                      {"id": 1.0, "event": "done"}):
            with pytest.raises(handoff.BadFrame):
                reception.on_frame(object(), frame)
        reception.on_frame(object(), {"id": 7, "event": "begun"})  # a connection it was not handed: ignored
        for rest in ("!!", 12, "é"):  # a next request's first bytes that are not base64 text
            with pytest.raises(handoff.BadFrame):
                handoff.decode(rest)
        assert handoff.decode("QUJD") == b"ABC"
    finally:
        listener.close()
