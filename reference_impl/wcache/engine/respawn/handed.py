"""A ``--respawn`` worker's side of the handoff (engine/respawn/handoff.py, engine/respawn/reception.py): it
serves each connection its supervisor hands it, one request at a time, with the worker's own HTTP
server and handler (server.py on http_front.py: the same routes, limits and refusals as a plain
``wcache serve``), then gives the connection back.

The handler is the server's own class, extended: its reader starts with the bytes the supervisor
read, it answers one request, and it tells the supervisor ``begun`` before the first byte of the
answer leaves (so a death after that is never answered twice) and ``done`` after the last.
"""

from __future__ import annotations

import logging
import re
import socket
import threading

from wcache.engine.respawn import handoff

log = logging.getLogger("wcache.engine")
_CONTENT_LENGTH = re.compile(rb"^content-length: *([0-9]{1,12})\r?$", re.M)


class HandedConnections(threading.Thread):
    def __init__(self, channel: socket.socket, server):
        super().__init__(name="wcache-handoff", daemon=True)
        self.channel, self.server = channel, server
        self._send_lock = threading.Lock()  # many answering threads report on one channel
        self.handler = _handed_handler(server.RequestHandlerClass, self)

    def report(self, frame: dict) -> None:
        with self._send_lock:
            try:
                handoff.send(self.channel, frame)
            except OSError:
                pass  # the supervisor is gone; PR_SET_PDEATHSIG ends this process

    def run(self) -> None:
        while True:
            try:
                frame, fd = handoff.recv(self.channel)
            except (handoff.ChannelClosed, OSError, ValueError):
                return
            if fd is None:
                continue
            conn = socket.socket(fileno=fd)
            threading.Thread(target=self._serve, args=(frame["id"], conn, handoff.decode(frame["data"])),
                             name="wcache-handed", daemon=True).start()

    def _serve(self, cid: int, conn: socket.socket, data: bytes) -> None:
        try:
            peer = conn.getpeername()
        except OSError:
            peer = ("", 0)
        handler = None
        try:
            handler = self.handler(conn, peer, self.server, cid, data)
        except Exception:  # noqa: BLE001  (the answer failed: the connection is closed below)
            log.debug("a handed connection failed", exc_info=True)
        finally:
            self.server.connections.forget(conn)
            keep = handler is not None and not handler.close_connection
            rest = bytes(handler.rfile.buf) if keep else b""
            if not keep:
                try:
                    conn.shutdown(socket.SHUT_RDWR)  # the client sees the end now, whatever the supervisor holds
                except OSError:
                    pass
            conn.close()  # this process's descriptor only: the supervisor keeps the connection
            self.report({"id": cid, "event": "done", "keep": keep, "rest": handoff.encode(rest)})


def _handed_handler(base, desk: HandedConnections):
    class Handed(base):
        def __init__(self, request, client_address, server, cid: int, prefill: bytes):
            self.cid, self.prefill, self.begun = cid, prefill, False
            super().__init__(request, client_address, server)

        def setup(self) -> None:
            super().setup()
            self.rfile.buf += self.prefill

        def handle(self) -> None:
            self.close_connection = True
            self.handle_one_request()  # one request; the supervisor waits for the next

        def flush_headers(self) -> None:
            if not self.begun and getattr(self, "_headers_buffer", None):
                self.begun = True
                head = b"".join(self._headers_buffer)
                lower = head.lower()
                length = _CONTENT_LENGTH.search(lower)
                desk.report({"id": self.cid, "event": "begun", "stream": b"text/event-stream" in lower,
                             "chunked": b"transfer-encoding: chunked" in lower,
                             # the whole answer's bytes, where the head says: the supervisor can then tell
                             # an answer written whole from one cut (reception.worker_died)
                             "length": len(head) + int(length.group(1)) if length and self.command != "HEAD"
                             else None})
            super().flush_headers()

    Handed.__name__ = f"Handed{base.__name__}"
    return Handed
