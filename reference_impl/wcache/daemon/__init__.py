"""Daemon side: `wcache preload` (launcher), one daemon per device rank (rank), autotune-cache seeding."""

import time

# When this interpreter reached the daemon package, before a rank's own imports: the start of the
# "imports" phase a rank reports (rank.START_PHASES), which `wcache bench` splits a restart by.
ENTERED = time.monotonic()
