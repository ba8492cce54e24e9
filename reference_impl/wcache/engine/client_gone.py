"""Has the client of a connection gone away? Asked between decode steps of a non-streamed
completion, whose handler writes nothing until the end and so would never notice a closed socket.

A poll that does not wait: ``POLLRDHUP`` is the peer's FIN (it closed, or shut down its sending
side, which no HTTP client does while it waits for an answer), ``POLLHUP``/``POLLERR`` a reset.
Bytes waiting (a pipelined next request) or nothing yet mean the client is still there. A poll, not
``recv(MSG_PEEK | MSG_DONTWAIT)``: Python waits for readability up to a socket's timeout before any
``recv``, flags or not. One system call per decode step, nothing next to the step itself.
"""

from __future__ import annotations

import select
import socket

_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)


def peer_closed(sock: socket.socket) -> bool:
    try:
        fd = sock.fileno()
    except OSError:
        return True
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN | _GONE)
    return any(ev & _GONE for _, ev in poller.poll(0))
