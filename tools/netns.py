"""A private network namespace for this process: its own loopback, its own ports (needs root).

Used by the Kubernetes probe harness (k8s_probe.py: a pod's network) and by the GPU test tier's
workers (gpu_worker_python: each worker's guide pages listen on the fixed ports a reader's copy
would, 8000 and up, so workers side by side need a loopback each)."""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


class NamespaceError(Exception):
    pass


def private_loopback() -> None:
    """Move this process into a new network namespace and bring its loopback up."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NamespaceError(f"unshare(CLONE_NEWNET) failed: {os.strerror(err)}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, ifr)[:18])[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))
