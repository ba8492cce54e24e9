"""What the --respawn supervisor does with a dead worker's connections, decided by the bytes the
kernel says were written (reception.written), not by the worker's ``begun``: real TCP connections,
a real handoff channel, the worker's side played here."""

from __future__ import annotations

import socket
import time

import pytest

from wcache.engine.respawn import handoff
from wcache.engine.respawn.reception import Reception, written

REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"ok\": 1} "
LIMITS = {"max_body": 1 << 20, "max_connections": 8, "idle_timeout_s": 60, "request_deadline_s": 60,
          "head_grace_s": 1}


class Worker:
    """The supervisor's view of a worker: its end of the channel; ``theirs`` is the worker's."""

    def __init__(self, pid: int):
        self.pid = pid
        self.channel, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def take(self) -> tuple[dict, socket.socket]:
        frame, fd = handoff.recv(self.theirs)
        return frame, socket.socket(fileno=fd)


@pytest.fixture
def desk():
    listener = socket.create_server(("127.0.0.1", 0))
    reception = Reception(listener, LIMITS, {"error_type": "InternalServerError"})
    clients = []

    def handed_request(worker: Worker) -> tuple[socket.socket, dict, socket.socket]:
        """A client's request, read by the supervisor and handed to ``worker``."""
        client = socket.create_connection(listener.getsockname())
        clients.append(client)
        client.sendall(REQUEST)
        before = reception.next_id
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and reception.next_id == before:
            reception.readable([listener] + reception.fds()[1:])
            time.sleep(0.01)
        frame, conn = worker.take()
        return client, frame, conn

    yield reception, handed_request
    for c in clients:
        c.close()
    reception.close_all()
    listener.close()


def test_the_kernel_counts_what_was_written_to_a_connection():
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as client:
        server, _ = listener.accept()
        with server:
            assert written(server) == 0
            server.sendall(b"x" * 1000)
            server.setblocking(False)
            queued = 0
            try:  # a peer that does not read: the rest waits in the send queue, and counts
                while True:
                    queued += server.send(b"y" * 65536)
            except BlockingIOError:
                pass
            assert written(server) == 1000 + queued
            assert client.recv(10) == b"x" * 10
    a, b = socket.socketpair()
    with a, b:
        assert written(a) is None  # not TCP: the kernel cannot say


def test_a_worker_killed_after_begun_but_before_its_first_byte_has_the_request_handed_again(desk):
    reception, handed_request = desk
    first, second = Worker(101), Worker(102)
    reception.worker_ready(first)
    client, frame, conn = handed_request(first)
    assert handoff.decode(frame["data"]) == REQUEST
    reception.on_frame(first, {"id": frame["id"], "event": "begun", "stream": True, "chunked": True})
    conn.close()  # it dies with nothing written
    assert reception.worker_died(first, "crash") == (1, 0, 0, 0)
    reception.worker_ready(second)
    frame2, conn2 = second.take()
    assert handoff.decode(frame2["data"]) == REQUEST  # the same request, to the next worker
    conn2.sendall(ANSWER)
    assert client.recv(1024) == ANSWER


def test_an_answer_written_whole_stays_with_its_client_and_a_partial_one_is_closed(desk):
    reception, handed_request = desk
    worker = Worker(103)
    reception.worker_ready(worker)
    whole_client, f1, c1 = handed_request(worker)
    cut_client, f2, c2 = handed_request(worker)
    for f in (f1, f2):
        reception.on_frame(worker, {"id": f["id"], "event": "begun", "stream": False, "length": len(ANSWER)})
    c1.sendall(ANSWER)
    c2.sendall(ANSWER[:20])
    assert reception.worker_died(worker, "crash") == (0, 1, 0, 1)
    for client, want in ((whole_client, ANSWER), (cut_client, ANSWER[:20])):
        client.settimeout(5)
        got = b""
        while chunk := client.recv(1024):
            got += chunk
        assert got == want  # then the end of the connection
    assert not reception.queue


def test_a_stream_with_bytes_written_ends_with_an_error_event(desk):
    reception, handed_request = desk
    worker = Worker(104)
    reception.worker_ready(worker)
    client, frame, conn = handed_request(worker)
    reception.on_frame(worker, {"id": frame["id"], "event": "begun", "stream": True, "chunked": False})
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: {}\n\n")
    assert reception.worker_died(worker, "worker pid 104 died") == (0, 0, 1, 0)
    client.settimeout(5)
    got = b""
    while chunk := client.recv(1024):
        got += chunk
    assert got.endswith(b"\n\n") and b"worker pid 104 died" in got.rsplit(b"data: ", 1)[1]


@pytest.mark.parametrize("length", ["12", -1, 1.5, True])
def test_a_worker_that_lies_about_its_answer_length_breaks_the_protocol(desk, length):
    reception, handed_request = desk
    worker = Worker(105)
    reception.worker_ready(worker)
    _, frame, _ = handed_request(worker)
    with pytest.raises(handoff.BadFrame):
        reception.on_frame(worker, {"id": frame["id"], "event": "begun", "length": length})
