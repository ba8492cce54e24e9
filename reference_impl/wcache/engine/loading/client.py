"""One connection from an engine rank to its daemon rank: checked before trusted, then requests.

Before it sends anything the client checks who it reached. The socket file must be a socket of
this engine's uid (``sockets.check_socket_file``), and the process listening on it
(``SO_PEERCRED``) must run as that same uid (root counts as trusted only where the engine runs as
root). Checking the file alone is not enough in a group-shared socket directory: another member of
the group can swap its own listener in between the engine's ``lstat`` and its ``connect``, and the
engine would map that process's weights. Such a peer is refused with its own reason
(``untrusted_peer``), before a request is sent.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from wcache.engine.loading.config import LoaderConfig
from wcache.errors import CacheUnusable
from wcache.wire.protocol import (
    ProtocolError,
    close_fds,
    recv_frame,
    request,
    send_frame,
)
from wcache.wire.sockets import check_socket_file, peer_cred

ROOT_UID = 0


def trusted_uids() -> set[int]:
    """Peers this engine trusts: its own uid (the daemon refuses any other, see security.md), and
    root, which could read the weights' memory anyway."""
    return {os.getuid(), ROOT_UID}


class CacheClient:
    """One connection to a daemon rank; ``call`` sends a request and reads the answer."""

    def __init__(self, path: Path, lc: LoaderConfig):
        self.path = path
        self.lc = lc
        if not os.path.lexists(path):
            raise CacheUnusable("no_socket", path=path)
        try:
            check_socket_file(path)
            owner = os.lstat(path).st_uid
        except OSError as e:
            raise CacheUnusable("unsafe_socket", path=path, error=e) from None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(lc.connect_timeout_s)
        try:
            self.sock.connect(str(path))
            self.peer_pid, self.peer_uid, _ = peer_cred(self.sock)
        except OSError as e:
            self.sock.close()
            raise CacheUnusable("refused", path=path, error=e) from None
        if self.peer_uid != owner or self.peer_uid not in trusted_uids():
            self.sock.close()
            raise CacheUnusable("untrusted_peer", path=path, pid=self.peer_pid, uid=self.peer_uid, owner=owner,
                                own=os.getuid())
        self.sock.settimeout(lc.state_timeout_s)

    def call(self, op: str, **fields) -> tuple[dict, list[int]]:
        try:
            try:
                send_frame(self.sock, request(op, **fields))
            except ConnectionError as e:
                # The daemon hung up before reading the request; a refusal it sent first ("busy",
                # "rejected") is still queued on our side, so read it before blaming the daemon.
                try:
                    answer, fds = recv_frame(self.sock)
                except (ProtocolError, EOFError, OSError):
                    raise e from None
            else:
                answer, fds = recv_frame(self.sock)
        except TimeoutError:
            raise CacheUnusable("timeout", path=self.path, timeout=self.lc.state_timeout_s) from None
        except (EOFError, ConnectionError) as e:  # killed, crashed or stopped mid-handoff
            raise CacheUnusable("lost", path=self.path, error=str(e) or type(e).__name__) from None
        except (ProtocolError, OSError) as e:
            raise CacheUnusable("protocol", detail=str(e) or type(e).__name__) from None
        if not answer.get("ok"):
            close_fds(fds)
            raise refusal(answer, self.path)
        return answer, fds

    def close(self) -> None:
        self.sock.close()


def refusal(answer: dict, path: Path) -> CacheUnusable:
    """The reason for a daemon's ``{"ok": false}`` answer."""
    kind = answer.get("error")
    if kind == "mismatch":
        return CacheUnusable("mismatch", fields=answer.get("fields"))
    if kind == "released":
        return CacheUnusable("released")
    if kind == "rejected":
        return CacheUnusable("rejected", uid=os.getuid())  # the uid the daemon saw, outside user namespaces
    if kind == "busy":
        return CacheUnusable("busy", path=path, detail=answer.get("message"))
    if kind == "fds_in_flight":
        return CacheUnusable("fds_in_flight", path=path, detail=answer.get("message"))
    return CacheUnusable("protocol", detail=f"{kind}: {answer.get('message')}")
