"""One module per way of sharing an arena (memfd, cuda_ipc, cuda_vmm), and auto: which one a daemon serves.

The transport modules subclass wire/arena.py's classes, and arena.py's table of kinds imports them:
importing arena.py first, whichever module is asked for, keeps that cycle in one order.
"""

from wcache.wire import arena  # noqa: F401
