"""Where the daemon's socket lives, and the checks both sides make before trusting it.

Default directory: ``$TMPDIR/wcache_<uid>``, mode 0700, created by whichever side comes first.
A socket is named after its device (``socket_name``) unless that path would not fit a Unix socket
address: then by a short digest of the name (``socket_path_for``), so neither TMPDIR's depth nor a long
device identity (a GPU UUID is 40 bytes) can keep a daemon from binding.
Symlinked or foreign-owned directories and sockets are refused on both sides; the default
directory is also refused when group or world can enter it. The daemon holds an exclusive flock
on ``<socket>.lock`` for its lifetime, taken before anything else it does, so a second daemon for
the same device fails fast and a crashed daemon's stale socket is replaced by the next owner of the
lock (only a socket that refuses connections counts as stale: see clear_stale_socket).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import socket
import stat
import struct
import tempfile
from pathlib import Path

from wcache.errors import STALE_SOCKET_REMOVED, DaemonLockError, SocketSecurityError

log = logging.getLogger("wcache.daemon")

SOCKET_PREFIX = "wcache_weight_cache_"
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes including the terminating NUL


def default_socket_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"wcache_{os.getuid()}"


def prepare_socket_dir(explicit: str | os.PathLike | None, create: bool = True) -> Path:
    d = Path(explicit) if explicit else default_socket_dir()
    if create and not os.path.lexists(d):
        try:
            os.makedirs(d, mode=0o700)
        except FileExistsError:
            pass
    if not os.path.lexists(d):
        return d  # the engine may look before the daemon made it; connecting will say so
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode):
        raise SocketSecurityError(SocketSecurityError.SYMLINK_DIR.format(dir=d))
    if not stat.S_ISDIR(st.st_mode):
        raise SocketSecurityError(SocketSecurityError.NOT_A_DIR.format(dir=d))
    if st.st_uid != os.getuid():
        raise SocketSecurityError(SocketSecurityError.NOT_OWNED_DIR.format(dir=d))
    if not explicit and st.st_mode & 0o077:
        raise SocketSecurityError(SocketSecurityError.OPEN_DIR.format(dir=d))
    return d


def socket_name(device_id: str, draft: bool = False) -> str:
    return f"{SOCKET_PREFIX}{device_id}{'_draft' if draft else ''}.sock"


def socket_path_for(directory: Path, device_id: str, draft: bool = False) -> Path:
    """Where the daemon of ``device_id`` serves in ``directory``, the same on both sides: the
    device's own name when the path fits in a Unix socket address, else a 12-hex digest of that name
    (37 bytes; who answers is still checked by the device identity in every get_state reply)."""
    name = socket_name(device_id, draft)
    path = Path(directory) / name
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    return Path(directory) / f"{SOCKET_PREFIX}{hashlib.sha256(name.encode()).hexdigest()[:12]}.sock"


def short_private_dir(prefix: str) -> Path:
    """A new directory of mode 0700 whose path is short whatever TMPDIR is (sockets go in it):
    under /run/user/<uid> or /tmp where this user may write, else under TMPDIR."""
    for base in (f"/run/user/{os.getuid()}", "/tmp"):
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            return Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    return Path(tempfile.mkdtemp(prefix=prefix))


def bind_private_socket(path: Path) -> socket.socket:
    """A Unix socket bound at ``path`` with mode 0600 from its first moment (umask, then bind):
    no other user can connect in the window between bind and a chmod."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    return sock


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))


def check_socket_file(path: Path) -> None:
    """Raise OSError describing why ``path`` is not a socket we may trust."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise OSError(f"{path} is a symlink")
    if st.st_uid != os.getuid():
        raise OSError(f"{path} is owned by uid {st.st_uid}, not {os.getuid()}")
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} is not a socket")


class DaemonLock:
    """Exclusive, non-blocking flock on ``<socket>.lock``, held until the daemon exits."""

    def __init__(self, socket_path: Path):
        self.path = Path(str(socket_path) + ".lock")
        self.fd: int | None = None
        self.waited = False  # taken only after waiting for a running daemon to stop (a standby's takeover)

    def acquire(self, on_wait=None) -> None:
        """Take the lock now; if another daemon holds it, raise DaemonLockError, or, given
        ``on_wait``, call it and then block until that daemon's lock is released (a standby: the
        kernel drops a flock the moment its last holder exits, however it exits)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as e:  # each cause its own message: none of these is another daemon
            if e.errno == errno.ELOOP:
                raise DaemonLockError(self.path, DaemonLockError.SYMLINK) from None
            raise DaemonLockError(self.path, DaemonLockError.CANNOT_OPEN, error=e.strerror or e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is None:
                os.close(fd)
                raise DaemonLockError(str(socket_path_of(self.path))) from None
            try:
                on_wait(socket_path_of(self.path))
                fcntl.flock(fd, fcntl.LOCK_EX)  # a signal whose handler raises ends the wait
            except BaseException:
                os.close(fd)
                raise
            self.waited = True
        self.fd = fd

    @classmethod
    def inherited(cls, socket_path: Path, fd: int) -> DaemonLock:
        """The lock a launcher took for this rank and passed down as descriptor ``fd`` (the same
        open file, so the flock is already ours; taking it again on it only confirms that)."""
        lock = cls(socket_path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DaemonLockError(str(socket_path)) from None
        os.set_inheritable(fd, False)
        lock.fd = fd
        return lock

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# The only connect outcomes that prove no process serves a socket: nobody listens on the file
# (ECONNREFUSED), or it is gone (ENOENT). A full listen backlog (EAGAIN), a timeout or anything
# else is a process that is stopped, swamped or slow, and its socket is not ours to remove.
STALE_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ENOENT})


def connect_error(path: Path, timeout: float = 1.0) -> OSError | None:
    """What connecting to the Unix socket at ``path`` raised, or None when a process accepted."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(path))
        except OSError as e:  # TimeoutError is an OSError without an errno
            return e
        return None


def clear_stale_socket(path: Path) -> bool:
    """Remove the socket file at ``path`` if it is provably stale; True when one was removed.

    Called only by the holder of the socket's lock: whatever is there should be a dead daemon's.
    But a lock file can be removed under a live daemon (a tmp cleaner, a process of the user), so
    the file is removed only when connecting to it is refused or finds nothing; any other outcome
    raises DaemonLockError and leaves both the socket and whoever serves it alone."""
    if not os.path.lexists(path):
        return False
    error = connect_error(path)
    if error is None:
        raise DaemonLockError(path, DaemonLockError.LIVE_SOCKET)
    if error.errno not in STALE_ERRNOS:
        reason = os.strerror(error.errno) if error.errno else (str(error) or type(error).__name__)
        raise DaemonLockError(path, DaemonLockError.UNSURE_SOCKET, error=reason)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def claim_socket(path: Path, lock: DaemonLock | None = None, on_wait=None) -> DaemonLock:
    """The lock of the socket at ``path`` (taken now unless ``lock`` already holds it), with any
    stale socket file of a dead daemon removed. Nothing else is done before this: a daemon that
    does not own its device stops here, before it reads weights or writes a record (or, given
    ``on_wait``, waits here for that daemon to stop: DaemonLock.acquire)."""
    if lock is None:
        lock = DaemonLock(path)
        lock.acquire(on_wait)
    try:
        if clear_stale_socket(path):
            log.warning(STALE_SOCKET_REMOVED.format(path=path))
    except DaemonLockError:
        lock.release()
        raise
    return lock


def socket_path_of(lock_path: Path) -> Path:
    return Path(str(lock_path).removesuffix(".lock"))
