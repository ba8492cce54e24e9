"""The engine's lease on a daemon's memory: what it maps, the connection that says so, the hand-back.

In ``zero_copy`` mode the daemon keeps its arena while a lease connection is open, so the lease
owns, and closes together: the open connection, the mapping of the daemon's memory, and (memfd
and VMM arenas) one descriptor of the arena with the ``ArenaOffer`` that hands it to a restarted
daemon. The offer's thread replaces the connection when it leases again (``replace_connection``);
the engine's own requests (``memory``) take the same lock, so neither ever sees a half-swapped one.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
from pathlib import Path

from wcache.engine.loading.client import CacheClient
from wcache.errors import CacheUnusable
from wcache.wire.handback import ArenaOffer
from wcache.wire.protocol import close_fds

log = logging.getLogger("wcache.engine.loader")


class CacheLease:
    def __init__(self, client: CacheClient):
        self.path: Path = client.path
        self.kind: str | None = None  # the arena kind (memfd, cuda_ipc, vmm_fd)
        self.external_bytes = 0  # bytes of the daemon's memory this engine maps
        self.mapping = None  # transport.MappedArena over the daemon's memory
        self.offer: ArenaOffer | None = None
        self._client = client
        self._handback_fd: int | None = None  # kept for the offer until one takes it
        self._lock = threading.Lock()
        self._closed = False

    @property
    def sock(self) -> socket.socket:
        return self._client.sock

    def call(self, op: str, **fields) -> tuple[dict, list[int]]:
        """One request over the lease connection (CacheUnusable when the daemon cannot answer)."""
        with self._lock:
            return self._client.call(op, **fields)

    def keep_descriptor(self, fd: int) -> None:
        self._handback_fd = os.dup(fd)

    def release_mapping(self) -> None:
        """Let go of the daemon's memory (copy mode, once the engine has its own copy)."""
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        self.external_bytes = 0

    def offer_back(self, state: dict, key: dict, connect) -> None:
        """Watch the lease and offer the arena to a restarted daemon if this one goes (handback.py).
        ``connect()``: (socket, answer, fds) of a new zero_copy get_state on this lease's path."""
        if self._handback_fd is None:
            return
        fd, self._handback_fd = self._handback_fd, None  # the offer closes it from now on
        self.offer = ArenaOffer(self.sock, state, fd, key, self.path, connect, self.replace_connection)

    def replace_connection(self, sock: socket.socket) -> None:
        """Hold ``sock`` as the lease from now on (a restarted daemon serving the same arena)."""
        with self._lock:
            old, self._client.sock = self._client.sock, sock
        old.close()

    def memory(self) -> int:
        """Bytes the daemon holds for this engine, as it reports them (``get_memory``): exactly its
        cached tensor bytes. Raises CacheUnusable when it cannot answer or answers nonsense."""
        answer, fds = self.call("get_memory")
        close_fds(fds)
        held = answer.get("weights_bytes")
        if isinstance(held, bool) or not isinstance(held, int) or held < 0:
            raise CacheUnusable("protocol", detail=f"get_memory answered weights_bytes {held!r}")
        return held

    def close(self) -> None:
        """Tell the daemon this engine no longer maps its memory. The offer goes first: it watches
        the connection closed last."""
        if self._closed:
            return
        self._closed = True
        if self.offer is not None:
            self.offer.close()
            self.offer = None
        if self._handback_fd is not None:
            close_fds([self._handback_fd])
            self._handback_fd = None
        self.release_mapping()
        with self._lock:
            self._client.close()


def daemon_alive(lease) -> float:
    """1.0 while a zero_copy lease's connection is open at the daemon's end, 0.0 once it hung up.
    Polled without reading: the lease's own thread (handback.ArenaOffer) watches the same socket."""
    try:
        fd = lease.sock.fileno()
    except (AttributeError, OSError):
        return 0.0
    if fd < 0:
        return 0.0
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)
    gone = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL
    return 0.0 if any(ev & gone for _, ev in poller.poll(0)) else 1.0
