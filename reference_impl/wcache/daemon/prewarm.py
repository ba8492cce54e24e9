"""Start the first daemon rank's interpreter before the launcher imports torch.

A rank is a fresh interpreter that imports torch and wcache (seconds: most of a daemon restart that
adopts its arena). The launcher imports torch too, to build the configuration and plan the ranks,
and only then could it spawn a rank: two imports of torch one after the other. So `wcache preload`
spawns one rank process first thing, before importing anything heavy: it imports while the
launcher plans, then waits on a socket pair for its spec and, with it (SCM_RIGHTS), the device's
lock that the launcher took before planning (lock first: see launcher.claim_rank_sockets). The
launcher hands both to the first rank it plans (``take``); the others are spawned as before. If the launcher stops before it hands the
spec over (a bad configuration, a stop signal), it kills the waiting rank, which has touched
nothing; if the launcher dies, the rank reads end-of-file on its spec socket and exits. Standard library only: importing this module must cost nothing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

SPEC_FD_ENV = "WCACHE_PIPED_RANK_SPEC"  # the descriptor of the socket the spec comes on (internal, like WCACHE_RANK_SPEC)
MAX_SPEC_BYTES = 1 << 20


class Prewarmed:
    """A rank interpreter waiting for its spec: its process, the spec socket and the ready pipe."""

    def __init__(self):
        self.spec_w, spec_r = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ready_r, self.ready_w = os.pipe()
        os.set_inheritable(self.ready_r, False)
        self.spawned_at = time.monotonic()
        env = dict(os.environ, **{SPEC_FD_ENV: str(spec_r.fileno())})
        self.proc = subprocess.Popen([sys.executable, "-m", "wcache.daemon.rank"], env=env,
                                     pass_fds=(spec_r.fileno(), self.ready_w))
        spec_r.close()

    def hand(self, spec: dict, lock_fd: int) -> None:
        """Send the rank its spec (which names ``ready_w`` as its ready pipe) and its device lock."""
        import json

        os.close(self.ready_w)  # the rank holds its own copy
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
            self.spec_w = None


_waiting: Prewarmed | None = None


def start() -> None:
    global _waiting
    _waiting = Prewarmed()


def take() -> Prewarmed | None:
    """The waiting rank, once; None if none was started or it was taken already."""
    global _waiting
    taken, _waiting = _waiting, None
    return taken


def discard() -> None:
    """Let an untaken waiting rank go (the launcher is leaving)."""
    taken = take()
    if taken is not None:
        taken.discard()


def read_spec() -> dict | None:
    """In a rank: its spec from the environment, or from the launcher's socket (None: not needed)."""
    import json

    if SPEC_FD_ENV not in os.environ:
        return json.loads(os.environ["WCACHE_RANK_SPEC"])
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
