"""One module per way of sharing an arena (memfd, cuda_ipc, cuda_vmm), and auto: which one a daemon serves.

The transport modules subclass wire/arena.py's classes; wire/arenas.py, the table of kinds, imports them.
"""
