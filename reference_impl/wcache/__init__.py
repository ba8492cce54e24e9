"""wcache: keep post-processed model weights resident across engine restarts.

A long-lived daemon per device rank (``wcache preload``) loads a checkpoint once and hands the
weights to each new engine process (``wcache serve --load-format ipc_cache``), which maps them
instead of reading the checkpoint again.
"""

__version__ = "0.1.0"
