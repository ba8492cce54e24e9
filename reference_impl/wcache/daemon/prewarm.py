"""Start the first daemon rank's interpreter before the launcher imports torch.

A rank is a fresh interpreter that imports torch and wcache (seconds: most of a daemon restart that
adopts its arena). The launcher imports torch too, to build the configuration and plan the ranks,
and only then could it spawn a rank: two imports of torch one after the other. So `wcache preload`
spawns one rank process first thing, before importing anything heavy: it imports while the
launcher plans, then waits on a pipe for its spec. The launcher hands that spec to the first rank
it plans (``take``); the others are spawned as before. If the launcher stops before it hands the
spec over (a bad configuration, a stop signal), it kills the waiting rank, which has touched
nothing; if the launcher dies, the rank reads end-of-file on the pipe and exits. Standard library only: importing this module must cost nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

SPEC_FD_ENV = "WCACHE_PIPED_RANK_SPEC"  # the descriptor of the pipe the spec comes on (internal, like WCACHE_RANK_SPEC)


class Prewarmed:
    """A rank interpreter waiting for its spec: its process, the spec pipe and the ready pipe."""

    def __init__(self):
        spec_r, self.spec_w = os.pipe()
        self.ready_r, self.ready_w = os.pipe()
        os.set_inheritable(self.spec_w, False)
        os.set_inheritable(self.ready_r, False)
        self.spawned_at = time.monotonic()
        env = dict(os.environ, **{SPEC_FD_ENV: str(spec_r)})
        self.proc = subprocess.Popen([sys.executable, "-m", "wcache.daemon.rank"], env=env,
                                     pass_fds=(spec_r, self.ready_w))
        os.close(spec_r)

    def hand(self, spec: dict) -> None:
        """Send the rank its spec (which names ``ready_w`` as its ready pipe)."""
        import json

        os.close(self.ready_w)  # the rank holds its own copy
        with os.fdopen(self.spec_w, "w") as f:
            f.write(json.dumps(spec) + "\n")
        self.spec_w = None

    def discard(self) -> None:
        """Not needed: it has only imported, so it is killed (finishing its imports would keep a failed
        `wcache preload` waiting for seconds)."""
        if self.spec_w is not None:
            self.proc.kill()
            self.proc.wait()
            for fd in (self.spec_w, self.ready_w, self.ready_r):
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
    """In a rank: its spec from the environment, or from the launcher's pipe (None: not needed)."""
    import json

    if SPEC_FD_ENV not in os.environ:
        return json.loads(os.environ["WCACHE_RANK_SPEC"])
    try:
        with os.fdopen(int(os.environ.pop(SPEC_FD_ENV)), "r") as f:
            line = f.readline()
    except KeyboardInterrupt:  # Ctrl-C to the launcher's group while it planned: it is leaving too
        return None
    return json.loads(line) if line.strip() else None
