"""What NVML charges to each process of a daemon and a zero_copy engine (GPU host, root):
does a process that maps another's arena (vmm_fd descriptor, cuda_ipc handle) get the arena's bytes
in its own usedGpuMemory? The GPU tier's memory tests and the hot spare's reserve rely on the answer
(core/process_memory.py). Prints one JSON line per transport.

    PYTHONPATH=reference_impl:tests python3 tools/probes/nvml_probe.py
"""

import json
import os
import tempfile
import time
from pathlib import Path

from gpu.device_usage import process_tree as tree  # tests/gpu/device_usage.py
from procs import Processes, private_env
from wcache.core.checkpoint import make_checkpoint
from wcache.core.process_memory import processes_on_device


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="nvml-"))
    model = make_checkpoint(base / "small", "small")
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    for transport in ("vmm_fd", "cuda_ipc"):
        tmp = base / transport
        tmp.mkdir()
        with private_env(tmp / "cache") as env:
            procs = Processes(tmp, env, device="cuda")
            try:
                d = procs.preload(model, "--weight-cache-transport", transport)
                time.sleep(2)
                held = processes_on_device() or {}
                daemon = sum(held.get(p, 0) for p in tree(d.pid))
                e = procs.serve(model, "--load-format", "ipc_cache", "--gpu-memory-utilization", "0.05")
                time.sleep(2)
                held2 = processes_on_device() or {}
                engine = sum(held2.get(p, 0) for p in tree(e.pid))
                daemon2 = sum(held2.get(p, 0) for p in tree(d.pid))
                print(json.dumps({"transport": transport, "weights_mib": weights >> 20,
                                  "daemon_mib": daemon >> 20, "daemon_after_engine_mib": daemon2 >> 20,
                                  "engine_mib": engine >> 20, "all_pids_mib": {k: v >> 20 for k, v in held2.items()},
                                  "engine_log_zero_copy": "(zero_copy mode)" in e.log()}), flush=True)
            finally:
                procs.stop_all()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
