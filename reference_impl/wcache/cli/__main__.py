"""``python -m wcache.cli``: the ``wcache`` command where no console script is installed (the GPU
host's shim, tools/gpu_run.sh, and every test and bench that starts a real process)."""

import sys

from wcache.cli import main

sys.exit(main())
