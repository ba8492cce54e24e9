"""daemon/state_dir.py: the state directory is trusted only as sshd's StrictModes would trust it."""

from __future__ import annotations

import os
import stat

import pytest
from wcache.daemon.state_dir import UntrustedStateDir, open_dir


def opened(path) -> os.stat_result:
    fd = open_dir(path)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def test_a_missing_directory_is_made_private_and_opened(tmp_path):
    st = opened(tmp_path / "a" / "b")
    assert stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == (os.stat(tmp_path / "a" / "b").st_dev,
                                                                   os.stat(tmp_path / "a" / "b").st_ino)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o700  # every part it made


def test_below_a_root_owned_sticky_directory_is_fine(tmp_path):
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp: others may add entries, never replace ours
    if os.stat(sticky).st_uid != 0:
        pytest.skip("needs root: the sticky directory must be root's")
    opened(sticky / "mine")
    os.chmod(sticky / "mine", 0o1777)  # but a sticky directory as the state directory itself is not private
    with pytest.raises(UntrustedStateDir, match="is writable by group or others"):
        opened(sticky / "mine")


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_parent_others_can_write_is_refused(tmp_path, mode):
    (tmp_path / "p").mkdir()
    os.chmod(tmp_path / "p", mode)
    with pytest.raises(UntrustedStateDir, match=rf"{tmp_path}/p is writable by group or others \(mode {mode:o}\)"):
        opened(tmp_path / "p" / "state")


def test_symlinks_anywhere_are_refused(tmp_path):
    (tmp_path / "real" / "state").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UntrustedStateDir, match=rf"{tmp_path}/link is a symbolic link"):
        opened(tmp_path / "link" / "state")
    (tmp_path / "real" / "state2").symlink_to(tmp_path / "real" / "state")
    with pytest.raises(UntrustedStateDir, match="state2 is a symbolic link"):
        opened(tmp_path / "real" / "state2")


def test_another_owner_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    (tmp_path / "theirs").mkdir(mode=0o700)
    os.chown(tmp_path / "theirs", 65534, 65534)
    with pytest.raises(UntrustedStateDir, match="belongs to uid 65534, not to this user"):
        opened(tmp_path / "theirs")
    with pytest.raises(UntrustedStateDir, match="belongs to uid 65534, neither this user"):
        opened(tmp_path / "theirs" / "below")
    (tmp_path / "file").write_text("")
    with pytest.raises(UntrustedStateDir, match="is not a directory"):
        opened(tmp_path / "file" / "state")
