"""The daemon's state directory, opened the way sshd's StrictModes checks a user's files.

The state directory holds what a restarted daemon trusts (its arena records, with their hash
keys), so whoever can change it, or any directory above it, can make the daemon adopt memory of
their choosing. It is trusted only if, from ``/`` down to the directory itself:

* no component is a symbolic link (each is opened with O_NOFOLLOW relative to its parent's
  descriptor, so nothing swapped in during the walk is followed either);
* every component belongs to this user or to root;
* no component is writable by group or others, except a root-owned sticky directory such as
  ``/tmp`` above it: there others may add entries but not rename or remove ours, and the entry we
  open next must itself pass these checks;
* the directory itself (and every part the daemon creates, mode 0700) belongs to this user.

Everything inside is then read and written relative to the returned descriptor, with O_NOFOLLOW.
A directory that fails raises ``UntrustedStateDir`` with the reason; the caller disables hand-back.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UntrustedStateDir(Exception):
    """The state directory (or a directory above it) is not safe to trust; str() says why."""


def default_path() -> Path:
    explicit = os.environ.get("WCACHE_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "wcache"


def _check(st: os.stat_result, where: str, last: bool) -> None:
    me = os.getuid()
    if last and st.st_uid != me:
        raise UntrustedStateDir(f"{where} belongs to uid {st.st_uid}, not to this user (uid {me})")
    if st.st_uid not in (me, 0):
        raise UntrustedStateDir(f"{where} belongs to uid {st.st_uid}, neither this user (uid {me}) nor root")
    sticky_root = st.st_uid == 0 and st.st_mode & stat.S_ISVTX and not last
    if st.st_mode & 0o022 and not sticky_root:
        raise UntrustedStateDir(f"{where} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


def open_dir(path: Path, create: bool = True) -> int:
    """A descriptor (O_PATH) of the checked directory ``path``, made (0700) where missing if
    ``create``; raises UntrustedStateDir. The caller closes it."""
    parts = [p for p in os.path.abspath(path).split("/") if p]
    fd = os.open("/", DIR_FLAGS)
    where = "/"
    try:
        _check(os.fstat(fd), where, last=not parts)
        for i, name in enumerate(parts):
            where = os.path.join(where, name)
            last = i == len(parts) - 1
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    raise UntrustedStateDir(f"{where} does not exist") from None
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile: checked below like any other
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise UntrustedStateDir(f"{where} is a symbolic link")
            if not stat.S_ISDIR(st.st_mode):
                raise UntrustedStateDir(f"{where} is not a directory")
            try:
                nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UntrustedStateDir(f"{where} was replaced by a symbolic link or a file") from None
                raise
            os.close(fd)
            fd = nxt
            opened = os.fstat(fd)
            if not stat.S_ISDIR(opened.st_mode) or (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                raise UntrustedStateDir(f"{where} changed while it was checked")
            _check(opened, where, last)
        return fd
    except BaseException:
        os.close(fd)
        raise
