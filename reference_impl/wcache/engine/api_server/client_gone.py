"""Has the client of a connection gone away? Asked between decode steps of a non-streamed
completion, whose handler writes nothing until the end and so would never notice a closed socket.

A poll that does not wait: ``POLLHUP``/``POLLERR`` a reset, ``POLLRDHUP`` the peer's FIN. A FIN
alone does not say which: the client closed its socket, or only shut down its sending side after
its request (a half-close, which HTTP allows) and still waits for the answer. TCP tells the two
apart only when the server writes: a closed socket answers with a reset. So at the first FIN of an
HTTP/1.1 request, ``PeerWatch`` writes an interim ``100 Continue``, which every HTTP/1.1 client must
skip before the final answer (RFC 9110, section 15.2): a closed peer resets, and the next poll sees
it gone; a half-closed one reads on and gets its answer. An HTTP/1.0 client cannot be sent a 1xx,
so its FIN counts as gone.
Bytes waiting (a pipelined next request) or nothing yet mean the client is still there. A poll, not
``recv(MSG_PEEK | MSG_DONTWAIT)``: Python waits for readability up to a socket's timeout before any
``recv``, flags or not. One system call per decode step, nothing next to the step itself.
"""

from __future__ import annotations

import select
import socket


_HUNG_UP = select.POLLHUP | select.POLLERR | select.POLLNVAL
_FIN = getattr(select, "POLLRDHUP", 0)
INTERIM = b"HTTP/1.1 100 Continue\r\n\r\n"


class PeerWatch:
    """``gone()``, asked between decode steps: the client reset or closed (see the module's text)."""

    def __init__(self, sock: socket.socket, interim_allowed: bool):
        self.sock, self.interim_allowed, self.probed = sock, interim_allowed, False

    def gone(self) -> bool:
        events = _events(self.sock)
        if events is None or events & _HUNG_UP:
            return True
        if not events & _FIN:
            return False
        if not self.interim_allowed:
            return True
        if not self.probed:  # a closed peer answers this with a reset, seen at the next step
            self.probed = True
            try:
                self.sock.send(INTERIM, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except OSError:
                return True
        return False


def _events(sock: socket.socket) -> int | None:
    try:
        fd = sock.fileno()
    except OSError:
        return None
    if fd < 0:
        return None
    poller = select.poll()
    poller.register(fd, select.POLLIN | _HUNG_UP | _FIN)
    return sum(ev for _, ev in poller.poll(0))
