"""The CUDA transport on a real GPU: run with `make test-gpu` (or `pytest -m gpu`) on any CUDA host.

On a machine without CUDA every test here is skipped, with the reason printed by `-ra`.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest
import torch
from procs import Processes, complete

from wcache.core.checkpoint import make_checkpoint
from wcache.core.config import EngineConfig
from wcache.engine.engine import load_weights
from wcache.errors import LEASED_AGAIN
from wcache.engine.loader import LoaderConfig, load_from_cache
from wcache.wire.protocol import recv_frame, reply, send_frame

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `make test-gpu` on a GPU host)"),
]


@pytest.fixture(params=["cuda_ipc", "vmm_fd"])
def transport(request):
    if request.param == "vmm_fd":
        from wcache.wire import cuda_vmm

        if not cuda_vmm.available():
            pytest.skip("vmm_fd needs cuda-python's driver bindings (pip install cuda-bindings)")
    return request.param


@pytest.fixture
def gpu(tmp_path, wcache_env, transport):
    p = Processes(tmp_path, wcache_env, device="cuda")
    original = p.preload
    p.preload = lambda model, *extra, **kw: original(model, "--weight-cache-transport", transport, *extra, **kw)
    yield p
    p.stop_all()


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", "small")


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


def test_zero_copy_does_not_allocate_the_weights(gpu, small_model, transport):
    cfg = EngineConfig.build(str(small_model), device="cuda")
    torch.empty(1, device="cuda")
    gpu.preload(small_model)
    before = _free_bytes()
    weights, report = load_weights(cfg, "ipc_cache", LoaderConfig())
    used_zero_copy = before - _free_bytes()
    assert report.source == "the weight cache (zero_copy)"
    assert report.transport == {"cuda_ipc": "cuda_ipc", "vmm_fd": "cuda_vmm_fd"}[transport]
    size = report.nbytes
    for lease in report.keepalive:
        lease.close()
    del weights
    before = _free_bytes()
    weights, _ = load_weights(cfg, "safetensors")
    used_disk = before - _free_bytes()
    del weights
    torch.cuda.empty_cache()
    print(f"weights {size/2**20:.0f} MiB: device memory used by zero_copy {used_zero_copy/2**20:.0f} MiB, "
          f"by a disk load {used_disk/2**20:.0f} MiB")
    assert used_zero_copy < 0.1 * size
    assert used_disk > 0.9 * size


def test_copy_mode_release_returns_the_daemons_memory(gpu, small_model, wcache_env):
    cfg = EngineConfig.build(str(small_model), device="cuda")
    torch.empty(1, device="cuda")
    base = _free_bytes()
    gpu.preload(small_model)
    held = base - _free_bytes()
    # An earlier engine maps the weights and exits: with torch's IPC refcounts this pinned the
    # exporter's memory forever. Our lease ends with the connection.
    first = gpu.serve(small_model, "--load-format", "ipc_cache")
    first.stop()
    before_copy = _free_bytes()
    weights, report = load_weights(cfg, "ipc_cache", LoaderConfig(mode="copy"))
    assert report.source == "the weight cache (copy)"
    after_copy = _free_bytes()
    print(f"daemon held {held/2**20:.0f} MiB; engine copy {report.nbytes/2**20:.0f} MiB; "
          f"free before copy {before_copy/2**20:.0f}, after {after_copy/2**20:.0f} MiB")
    # The engine now owns one copy and the daemon freed its own: net change is near zero.
    assert abs(before_copy - after_copy) < 0.25 * report.nbytes, gpu.started[0].log()[-3000:]
    del weights


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
    weights, report = load_from_cache(cfg, LoaderConfig(socket_path=str(path)))
    assert weights is None
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
    """vmm_fd: the engine hands its allocation back and the new daemon allocates no second copy.
    cuda_ipc: the handle died with its daemon, so the new daemon loads from disk.

    Each daemon start also costs a CUDA context; comparing the two starts cancels it out."""
    torch.empty(1, device="cuda")
    weights = sum(f.stat().st_size for f in small_model.glob("*.safetensors"))
    free = _free_bytes()
    gpu.preload(small_model)
    first = free - _free_bytes()
    eng = gpu.serve(small_model, "--load-format", "ipc_cache")
    before = _ids(eng.port)
    gpu.started[0].kill_group()  # SIGKILL the launcher and its rank
    if transport == "vmm_fd":
        eng.wait_for_log("went away; this engine keeps serving", timeout=15)
    free = _free_bytes()
    second = gpu.preload(small_model)
    again = free - _free_bytes()
    log = second.log()
    print(json.dumps({"transport": transport, "weights_mib": round(weights / 2**20),
                      "first_daemon_took_mib": round(first / 2**20), "restarted_daemon_took_mib": round(again / 2**20),
                      "adopted": "adopted the arena of a running engine" in log}))
    if transport == "vmm_fd":
        assert "Rank 0 adopted the arena of a running engine" in log and "Rank 0 loaded" not in log
        eng.wait_for_log(LEASED_AGAIN.split(" at ")[0], timeout=15)
        assert first - again > 0.8 * weights
    else:
        assert "Rank 0 loaded" in log
        assert abs(first - again) < 0.2 * weights
    assert _ids(eng.port) == before
    fresh = gpu.serve(small_model, "--load-format", "ipc_cache")
    assert _ids(fresh.port) == before
