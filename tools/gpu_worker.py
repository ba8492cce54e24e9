"""The interpreter of one GPU-tier pytest-xdist worker: ``python3 tools/gpu_worker.py ARGS`` is
``python3 ARGS`` in a network namespace of its own (root only; tools/gpu_tier.sh passes it to
pytest-xdist as ``--tx N*popen//python=...``).

Why: the guide's pages listen on the fixed ports a reader's copy would (8000, 8001-8305, 29600...),
so two pages side by side on one host would take each other's ports. Each worker with a loopback of
its own runs any page beside any other, and the GPU tier spreads its pages over the GPU host's cores
instead of running them one after another (tests/parallel.py groups them per page then). The GPU
itself is shared: CUDA IPC and descriptor passing do not care about network namespaces.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns  # noqa: E402

WORKER_ENV = "WCACHE_TEST_OWN_LOOPBACK"  # tests/parallel.py reads it

netns.private_loopback()
os.environ[WORKER_ENV] = "1"
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
