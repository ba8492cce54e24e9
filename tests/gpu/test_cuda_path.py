"""The CUDA transport on a real GPU: run with `make test-gpu` (or `pytest -m gpu`) on any CUDA host.

On a machine without CUDA every test here is skipped, with the reason printed by `-ra`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from procs import Processes, call, complete

from wcache.core.config import EngineConfig
from wcache.engine.loading.registry import load_weights
from wcache.errors import LEASED_AGAIN
from wcache.engine.loading.config import LoaderConfig
from wcache.engine.loading.ipc_cache import IpcCacheLoader
from wcache.wire.protocol import recv_frame, reply, send_frame

from device_usage import bare_context_bytes, own_bytes, tree_bytes  # tests/gpu/device_usage.py

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `make test-gpu` on a GPU host)"),
]


@pytest.fixture(params=["cuda_ipc", "vmm_fd"])
def transport(request):
    if request.param == "vmm_fd":
        from wcache.wire.transports import cuda_vmm

        if not cuda_vmm.available():
            pytest.skip(f"vmm_fd needs the CUDA driver's VMM calls: {cuda_vmm._WHY_NOT}")
    return request.param


@pytest.fixture
def gpu(tmp_path, wcache_env, transport):
    p = Processes(tmp_path, wcache_env, device="cuda")
    original = p.preload
    p.preload = lambda model, *extra, **kw: original(model, "--weight-cache-transport", transport, *extra, **kw)
    yield p
    p.stop_all()


def _ids(port):
    return complete(port, "GPU parity", 12)["choices"][0]["token_ids"]


def test_outputs_identical_from_disk_zero_copy_and_copy(gpu, tiny_model):
    disk = gpu.serve(tiny_model)
    expected = _ids(disk.port)
    disk.stop()
    gpu.preload(tiny_model)
    zero = gpu.serve(tiny_model, "--load-format", "ipc_cache")
    assert "(zero_copy mode)" in zero.log()
    assert _ids(zero.port) == expected
    zero.stop()
    copy = gpu.serve(tiny_model, "--load-format", "ipc_cache", "--model-loader-extra-config", '{"mode": "copy"}')
    assert "(copy mode)" in copy.log()
    assert _ids(copy.port) == expected
    after = gpu.serve(tiny_model, "--load-format", "ipc_cache")
    assert "Weight cache unusable (Weights were released); falling back to disk loading" in after.log()
    assert _ids(after.port) == expected


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _settled_free_bytes(timeout: float = 30.0) -> int:
    """Free device memory once it stops changing: a killed or stopped process's memory returns
    while the driver tears its context down, after the process itself is gone."""
    last, deadline = _free_bytes(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _free_bytes()
        if abs(now - last) < 8 << 20:
            return now
        last = now
    return last


def _daemon_socket() -> Path:
    found = sorted(Path(os.environ["TMPDIR"]).rglob("wcache_weight_cache*.sock"))
    assert len(found) == 1, found
    return found[0]


def test_zero_copy_does_not_allocate_the_weights(gpu, small_model, transport):
    cfg = EngineConfig.build(str(small_model), device="cuda")
    torch.empty(1, device="cuda")
    gpu.preload(small_model)
    # Earlier tests in this process leave blocks in torch's caching allocator: a load that reused
    # them would look free. Each measurement starts with the cache given back to the driver.
    # Two measures: what the driver counts for this process (NVML: other processes of the GPU tier
    # do not move it, as they move the device's free memory), and the tensors this process's
    # allocator holds. The first misses an allocation the allocator serves from blocks it kept (empty_cache cannot give
    # back a live CUDA graph's pool, as an earlier module's engine may leave: at 14e8735 on an H100 a
    # disk load "used" 16 MiB of free memory for 469 MiB of weights); the second sees every tensor.
    torch.cuda.empty_cache()
    before, allocated = own_bytes(), torch.cuda.memory_allocated()
    weights, report, lease = load_weights(cfg, "ipc_cache", LoaderConfig())
    used_zero_copy = max(own_bytes() - before, torch.cuda.memory_allocated() - allocated)
    assert report.source == "the weight cache (zero_copy)"
    assert report.transport == transport  # one name per kind: the flag's value is the arena's kind
    size = report.nbytes
    lease.close()
    del weights
    torch.cuda.empty_cache()
    before, allocated = own_bytes(), torch.cuda.memory_allocated()
    weights, _, _lease = load_weights(cfg, "safetensors")
    used_disk = max(own_bytes() - before, torch.cuda.memory_allocated() - allocated)
    del weights
    torch.cuda.empty_cache()
    print(f"weights {size/2**20:.0f} MiB: device memory used by zero_copy {used_zero_copy/2**20:.0f} MiB, "
          f"by a disk load {used_disk/2**20:.0f} MiB")
    assert used_zero_copy < 0.1 * size
    assert used_disk > 0.9 * size


def test_copy_mode_release_returns_the_daemons_memory(gpu, small_model, wcache_env):
    cfg = EngineConfig.build(str(small_model), device="cuda")
    torch.empty(1, device="cuda")
    # Earlier tests in this process leave freed blocks in torch's caching allocator; the copy below
    # would reuse them and hide its own allocation from the device's free memory.
    torch.cuda.empty_cache()
    # The daemon's own memory as the driver counts it (its context, its arena, its allocator's
    # cache), not the device's free memory: the GPU tier's other processes move that.
    daemon = gpu.preload(small_model)
    held = tree_bytes(daemon.pid)
    # An earlier engine maps the weights and exits: with torch's IPC refcounts this pinned the
    # exporter's memory forever. Our lease ends with the connection.
    first = gpu.serve(small_model, "--load-format", "ipc_cache")
    first.stop()
    before_copy, reserved = tree_bytes(daemon.pid), torch.cuda.memory_reserved()
    allocated = torch.cuda.memory_allocated()
    loaded = load_weights(cfg, "ipc_cache", LoaderConfig(mode="copy"))
    loaded.settle()  # the release runs in the background, off the engine's way to serving
    weights, report, lease = loaded
    assert report.source == "the weight cache (copy)"
    after_copy = tree_bytes(daemon.pid)
    # What the copy took (the allocator may serve it from blocks it kept, which an earlier module's
    # live CUDA graph pool can leave), and the tensors it holds.
    ours = torch.cuda.memory_reserved() - reserved
    copy_held = torch.cuda.memory_allocated() - allocated
    freed_by_daemon = before_copy - after_copy
    print(json.dumps({"daemon_held_mib": round(held / 2**20), "copy_mib": round(report.nbytes / 2**20),
                      "our_copy_reserved_mib": round(ours / 2**20), "our_copy_allocated_mib": round(copy_held / 2**20),
                      "freed_by_daemon_mib": round(freed_by_daemon / 2**20)}))
    assert held >= report.nbytes, (held, report.nbytes)  # the daemon holds at least the weights it serves
    assert copy_held >= report.nbytes
    assert freed_by_daemon > 0.9 * report.nbytes, gpu.started[0].log()[-3000:]
    del weights
    torch.cuda.empty_cache()


def test_dtype_mismatch_is_named(gpu, tiny_model):
    gpu.preload(tiny_model)
    eng = gpu.serve(tiny_model, "--dtype", "float32", "--load-format", "ipc_cache")
    assert "WeightCacheKey mismatch on fields: ['dtype']" in eng.log()


def test_gpu_uuid_mismatch_is_named(tiny_model, wcache_env, tmp_path):  # transport-independent
    """A daemon that answers for another GPU (wrong socket mapping) is refused by UUID."""
    path = tmp_path / "fake.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)

    def fake_daemon():
        conn, _ = srv.accept()
        recv_frame(conn)
        send_frame(conn, reply(True, arena={"kind": "cuda_ipc", "size": 4096, "handle": ""}, tensors=[],
                               aliases={}, attrs={}, device_id="GPU-00000000-0000-0000-0000-000000000000"))
        conn.close()

    threading.Thread(target=fake_daemon, daemon=True).start()
    cfg = EngineConfig.build(str(tiny_model), device="cuda")
    _, report, lease = IpcCacheLoader(LoaderConfig(socket_path=str(path))).load(cfg)
    assert report.source == "disk" and lease is None
    assert report.fallback_reason.startswith("Daemon GPU GPU-00000000-0000-0000-0000-000000000000 != engine GPU GPU-")
    srv.close()


def test_fallback_when_no_daemon(gpu, tiny_model):
    eng = gpu.serve(tiny_model, "--load-format", "ipc_cache")
    assert "Weight cache unusable (no daemon socket at" in eng.log()


def test_zero_copy_engine_keeps_serving_after_the_daemon_is_killed(gpu, tiny_model):
    daemon = gpu.preload(tiny_model)
    eng = gpu.serve(tiny_model, "--load-format", "ipc_cache")
    before = _ids(eng.port)
    daemon.kill_group()  # SIGKILL the launcher and its rank
    after = _ids(eng.port)
    print(json.dumps({"zero_copy_after_daemon_sigkill": "served", "same_output": before == after}))
    assert before == after


def test_a_restarted_daemon_adopts_a_vmm_arena_and_reloads_a_cuda_ipc_one(gpu, small_model, transport):
    """vmm_fd: the engine hands its allocation back and the new daemon allocates no second copy; the
    arena's size is the same before and after (the allocation's size on both sides).
    cuda_ipc: the handle died with its daemon, so the new daemon loads a second copy from disk; the
    engine that still maps the first one answers the same.

    Each daemon's memory is what the driver counts for its processes (NVML), so the two starts
    compare directly (each pays a CUDA context) whatever else runs on the GPU. What a killed daemon's
    memory does while an engine still maps it (the driver's business: CUDA leaves an exporter's exit
    undefined, and on the H200 the kill returned the block in some runs and not in others) shows only
    in the device's free memory, which the GPU tier's other processes move: recorded, not asserted."""
    torch.empty(1, device="cuda")
    weights = sum(f.stat().st_size for f in small_model.glob("*.safetensors"))
    daemon = gpu.preload(small_model)
    first = tree_bytes(daemon.pid)
    size_before = call(_daemon_socket(), "get_memory")["arena_bytes"]
    eng = gpu.serve(small_model, "--load-format", "ipc_cache")
    before = _ids(eng.port)
    engine_took = tree_bytes(eng.pid)  # its context, KV cache and activations: no weights
    free = _settled_free_bytes()
    daemon.kill_group()  # SIGKILL the launcher and its rank
    if transport == "vmm_fd":
        eng.wait_for_log("went away; this engine keeps serving", timeout=15)
    kill_returned = _settled_free_bytes() - free  # device-wide: recorded only
    # The engine serves the same answers from the memory it maps, its daemon gone (both transports).
    assert _ids(eng.port) == before
    t0 = time.monotonic()
    second = gpu.preload(small_model)
    ready_s = time.monotonic() - t0
    again = tree_bytes(second.pid)
    log = second.log()
    record = {"transport": transport, "weights_mib": round(weights / 2**20),
              "first_daemon_holds_mib": round(first / 2**20), "engine_holds_mib": round(engine_took / 2**20),
              "kill_returned_device_mib": round(kill_returned / 2**20),
              "restarted_daemon_holds_mib": round(again / 2**20), "restart_to_ready_s": round(ready_s, 3),
              "adopted": "adopted the arena of a running engine" in log}
    print(json.dumps(record))
    if transport == "vmm_fd":
        assert "Rank 0 adopted the arena of a running engine" in log and "Rank 0 loaded" not in log
        eng.wait_for_log(LEASED_AGAIN.split(" at ")[0], timeout=15)
        assert call(_daemon_socket(), "get_memory")["arena_bytes"] == size_before
        assert first - again > 0.8 * weights, record  # the same context, no second arena
    else:
        assert "Rank 0 loaded" in log  # a second copy, read from disk
        # a context and a whole arena: against a bare context, not the first daemon, whose allocator also
        # kept what its autotune ran (on the H100 the restart, its autotune cache read, held 190 MiB less)
        context = bare_context_bytes()
        assert again > context + 0.8 * weights, {**record, "bare_context_mib": round(context / 2**20)}
    assert _ids(eng.port) == before
    fresh = gpu.serve(small_model, "--load-format", "ipc_cache")
    assert _ids(fresh.port) == before
