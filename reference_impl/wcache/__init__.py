"""wcache: keep post-processed model weights resident across engine restarts.

A long-lived daemon per device rank (``wcache preload``) loads a checkpoint once and hands the
weights to each new engine process (``wcache serve --load-format ipc_cache``), which maps them
instead of reading the checkpoint again.
"""

__version__ = "0.1.0"

# The wire format's version. A frame of another version is refused, and the version is a cache-key
# field, so a daemon and an engine that speak different versions never share weights. It lives here,
# beside __version__, so both the wire (protocol) and the core (fingerprint) take it without either
# importing the other.
PROTOCOL_VERSION = 1
