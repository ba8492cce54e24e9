"""Weight seeding on a GPU: a replica daemon on the same GPU, with no shard, seeded over TCP from a
small source. The bytes go through host memory and land in the replica's CUDA arena by its
transport's own pack; the keyed digests are checked on the GPU; an engine of the replica (a small
--gpu-memory-utilization) answers token for token as one of the source.

On a machine without CUDA every test here is skipped, with the reason printed by `-ra`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from procs import READY, Processes, free_port, http
from wcache.bench.seeding import small_files
from wcache.core.checkpoint import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `make test-gpu` on a GPU host)"),
]
TOKEN = "gpu-weights-token-0123456789"
SEEDED = re.compile(r"Rank 0 weights: seeded from \S+ \((\d+) tensors, .*TCP stream.*digests checked")


def texts(port: int) -> list[str]:
    out = []
    for prompt in ("Hello", "The weight cache", "1 2 3 4"):
        status, body = http("POST", f"http://127.0.0.1:{port}/v1/completions",
                            {"prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert status == 200, body
        out.append(body["choices"][0]["text"])
    return out


@pytest.mark.parametrize("transport", ["cuda_ipc", "vmm_fd"])
def test_a_replica_on_the_same_gpu_seeds_its_cuda_arena_and_answers_the_same_tokens(tmp_path, wcache_env, transport):
    if transport == "vmm_fd":
        from wcache.wire.transports import cuda_vmm

        if not cuda_vmm.available():
            pytest.skip(f"vmm_fd needs the CUDA driver's VMM calls: {cuda_vmm._WHY_NOT}")
    model = make_checkpoint(tmp_path / "small", "small")
    bare = small_files(model, tmp_path / "bare")
    procs = Processes(tmp_path, wcache_env, device="cuda")
    try:
        base = free_port()
        procs.preload(model, "--weight-cache-transport", transport, "--weight-cache-seed-listen",
                      f"127.0.0.1:{base}", "--weight-cache-seed-token", TOKEN, "--weight-cache-seed-round-window", "0")
        # a short socket directory: pytest's tmp_path under the tier's workers is past a Unix socket's 107 bytes
        sock_dir, root = Path(procs.env["TMPDIR"]) / "rs", tmp_path / "rroot"
        sock_dir.mkdir(mode=0o700)
        rep = procs.preload(bare, "--weight-cache-transport", transport, "--weight-cache-socket-dir", str(sock_dir),
                            "--weight-cache-seed", f"127.0.0.1:{base}", "--weight-cache-seed-token", TOKEN,
                            ready=False, name="replica", env={"WCACHE_CACHE_ROOT": str(root)})
        rep.wait_for_log(READY, timeout=300)
        assert SEEDED.search(rep.log()), rep.log()
        assert f"into a {transport} arena" not in rep.log()  # seeded, not loaded from disk
        loader = '{"socket_dir": "%s", "fallback": false, "transport": "%s"}' % (sock_dir, transport)
        mine = procs.serve(bare, "--load-format", "ipc_cache", "--model-loader-extra-config", loader,
                           "--gpu-memory-utilization", "0.15", env={"WCACHE_CACHE_ROOT": str(root)})
        theirs = procs.serve(model, "--load-format", "ipc_cache", "--gpu-memory-utilization", "0.15",
                             "--model-loader-extra-config", '{"fallback": false, "transport": "%s"}' % transport)
        assert texts(mine.port) == texts(theirs.port)
    finally:
        procs.stop_all()
