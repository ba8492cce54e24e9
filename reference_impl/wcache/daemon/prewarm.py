"""Start the first daemon rank's interpreter before the launcher imports and plans.

A rank is a fresh interpreter that imports torch and wcache (seconds: most of a daemon restart that
adopts its arena). The launcher imports no torch, but its own imports, the configuration and the
plan still come before it could spawn a rank. So `wcache preload` spawns one rank process first
thing: it imports while the launcher plans, then waits on a socket pair for its spec and, with it (SCM_RIGHTS), the device's
lock that the launcher took before planning (lock first: see launcher.claim_rank_sockets). The
launcher hands both to the first rank it plans (``take``); the others are spawned as before. If the launcher stops before it hands the
spec over (a bad configuration, a stop signal), it kills the waiting rank, which has touched
nothing; if the launcher dies, the rank reads end-of-file on its spec socket and exits. Standard library only: importing this module must cost nothing.

A standby launcher (``--weight-cache-standby``) prewarms every rank it will start, not only the
first, and waits until each has imported (``wait_imported``: the rank writes a byte on a pipe once
its imports are done) before it says it stands by: a takeover then pays none of them.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

SPEC_FD_ENV = "WCACHE_PIPED_RANK_SPEC"  # the descriptor of the socket the spec comes on (internal, like WCACHE_RANK_SPEC)
IMPORTED_FD_ENV = "WCACHE_PIPED_RANK_IMPORTED"  # the pipe a prewarmed rank writes a byte on once imported (internal)
MAX_SPEC_BYTES = 1 << 20


class Prewarmed:
    """A rank interpreter waiting for its spec: its process, the spec socket and the ready pipe."""

    def __init__(self):
        self.spec_w, spec_r = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ready_r, self.ready_w = os.pipe()
        self.imported_r, imported_w = os.pipe()
        self.spawned_at = time.monotonic()
        env = dict(os.environ, **{SPEC_FD_ENV: str(spec_r.fileno()), IMPORTED_FD_ENV: str(imported_w)})
        self.proc = subprocess.Popen([sys.executable, "-m", "wcache.daemon.rank"], env=env,
                                     pass_fds=(spec_r.fileno(), self.ready_w, imported_w))
        spec_r.close()
        os.close(imported_w)

    def imported(self, timeout: float | None) -> bool:
        """True once the rank has finished its imports (or has died: nothing left to wait for)."""
        if self.imported_r is None:
            return True
        if not select.select([self.imported_r], [], [], timeout)[0]:
            return False
        self._close_imported()
        return True

    def _close_imported(self) -> None:
        if self.imported_r is not None:
            os.close(self.imported_r)
            self.imported_r = None

    def hand(self, spec: dict, lock_fd: int) -> None:
        """Send the rank its spec (which names ``ready_w`` as its ready pipe) and its device lock."""
        import json

        os.close(self.ready_w)  # the rank holds its own copy
        self._close_imported()
        with self.spec_w:
            socket.send_fds(self.spec_w, [json.dumps(spec).encode() + b"\n"], [lock_fd])
        self.spec_w = None

    def discard(self) -> None:
        """Not needed: it has only imported, so it is killed (finishing its imports would keep a failed
        `wcache preload` waiting for seconds)."""
        if self.spec_w is not None:
            self.proc.kill()
            self.proc.wait()
            self.spec_w.close()
            for fd in (self.ready_w, self.ready_r):
                os.close(fd)
            self._close_imported()
            self.spec_w = None


_waiting: list[Prewarmed] = []  # in the order the launcher hands them out


def start(n: int = 1) -> None:
    """Have ``n`` rank interpreters waiting (more are started if fewer wait)."""
    while len(_waiting) < n:
        _waiting.append(Prewarmed())


def take() -> Prewarmed | None:
    """A waiting rank that is still alive, once; None when none is left (the caller spawns one)."""
    while _waiting:
        taken = _waiting.pop(0)
        if taken.proc.poll() is None:
            return taken
        taken.discard()
    return None


def wait_imported(poll_s: float = 0.2) -> None:
    """Until every waiting rank has imported (or died). A signal whose handler raises ends it."""
    while not all(w.imported(poll_s) or w.proc.poll() is not None for w in list(_waiting)):
        pass


def discard() -> None:
    """Let every untaken waiting rank go (the launcher is leaving)."""
    while _waiting:
        _waiting.pop(0).discard()


def report_imported() -> None:
    """In a prewarmed rank, its imports done: tell a standby launcher (a closed pipe is no error)."""
    fd = os.environ.pop(IMPORTED_FD_ENV, None)
    if fd is None:
        return
    try:
        os.write(int(fd), b"1")
    except OSError:
        pass
    finally:
        os.close(int(fd))


def read_spec() -> dict | None:
    """In a rank: its spec from the environment, or from the launcher's socket (None: not needed)."""
    import json

    if SPEC_FD_ENV not in os.environ:
        return json.loads(os.environ["WCACHE_RANK_SPEC"])
    report_imported()
    data, fds = b"", []
    try:
        with socket.socket(fileno=int(os.environ.pop(SPEC_FD_ENV))) as sock:
            while not data.endswith(b"\n") and len(data) < MAX_SPEC_BYTES:
                part, got, _flags, _addr = socket.recv_fds(sock, 65536, 1)
                fds += got
                if not part:
                    break
                data += part
    except KeyboardInterrupt:  # Ctrl-C to the launcher's group while it planned: it is leaving too
        return None
    if not data.strip():
        return None
    spec = json.loads(data)
    if fds:
        spec["lock_fd"] = fds[0]
    return spec
