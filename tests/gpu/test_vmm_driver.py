"""vmm_fd's driver calls (ctypes on libcuda.so.1) on a real GPU: the structs as cuda.h lays them out,
no leak when a map fails, and one arena size on every side."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `make test-gpu` on a GPU host)"),
]

from wcache.core.postprocess import ProcessedWeights  # noqa: E402
from wcache.wire.arena import Layout, manifest  # noqa: E402
from wcache.wire.transports import cuda_vmm  # noqa: E402

from device_usage import own_bytes  # noqa: E402  (tests/gpu/device_usage.py)

DEVICE = torch.device("cuda", 0)
PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %zu\n", sizeof(CUmemAllocationProp), offsetof(CUmemAllocationProp, location),
         offsetof(CUmemAllocationProp, win32HandleMetaData), offsetof(CUmemAllocationProp, allocFlags),
         sizeof(CUmemAccessDesc), offsetof(CUmemAccessDesc, flags), sizeof(CUmemLocation));
  printf("%d %d %d %d %d\n", (int)CU_MEM_ALLOCATION_TYPE_PINNED, (int)CU_MEM_LOCATION_TYPE_DEVICE,
         (int)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, (int)CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
         (int)CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  return 0;
}
"""


def _cuda_h() -> Path | None:
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    if shutil.which("nvcc"):
        roots.append(str(Path(shutil.which("nvcc")).resolve().parents[1]))
    for root in roots:
        if root and (Path(root) / "include" / "cuda.h").is_file():
            return Path(root) / "include"
    return None


@pytest.fixture(autouse=True)
def needs_vmm():
    if not cuda_vmm.available():
        pytest.skip(f"the CUDA driver here offers no VMM calls: {cuda_vmm._WHY_NOT}")


def _held() -> int:
    """What this process holds on the device (NVML: the GPU tier's other processes do not move it)."""
    torch.cuda.empty_cache()
    return own_bytes()


def test_structs_and_constants_are_laid_out_as_in_cuda_h(tmp_path):
    include, cc = _cuda_h(), shutil.which("cc") or shutil.which("gcc")
    if include is None or cc is None:
        pytest.skip("needs cuda.h (CUDA_HOME or /usr/local/cuda) and a C compiler to compare the ctypes layout")
    (tmp_path / "probe.c").write_text(PROBE)
    subprocess.run([cc, "-I", str(include), str(tmp_path / "probe.c"), "-o", str(tmp_path / "probe")], check=True)
    sizes, consts = subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True, check=True).stdout.splitlines()
    P, A = cuda_vmm.CUmemAllocationProp, cuda_vmm.CUmemAccessDesc
    ours = [ctypes.sizeof(P), P.location.offset, P.win32HandleMetaData.offset, P.allocFlags.offset,
            ctypes.sizeof(A), A.flags.offset, ctypes.sizeof(cuda_vmm.CUmemLocation)]
    print(f"cuda.h {include}: {sizes} / {consts}")
    assert [int(x) for x in sizes.split()] == ours
    assert [int(x) for x in consts.split()] == [
        cuda_vmm.CU_MEM_ALLOCATION_TYPE_PINNED, cuda_vmm.CU_MEM_LOCATION_TYPE_DEVICE,
        cuda_vmm.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, cuda_vmm.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        cuda_vmm.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED]


def test_a_failed_map_releases_the_imported_allocation():
    """Importing with a size larger than the allocation makes cuMemMap fail: the import's handle
    (and the reserved range) must go, or the memory outlives both exporter and importer."""
    torch.empty(1, device=DEVICE)
    size = 64 * cuda_vmm.granularity(DEVICE)
    base = _held()
    alloc = cuda_vmm.create(size, DEVICE)
    fd = cuda_vmm.export_fd(alloc)
    with pytest.raises(cuda_vmm.CudaVmmError, match="cuMemMap"):
        cuda_vmm.import_fd(os.dup(fd), 2 * size, DEVICE)
    os.close(fd)
    alloc.close()
    assert _held() - base < size // 4, "the failed import kept the allocation alive"


def test_a_vmm_arena_reports_its_allocation_size_everywhere():
    """One size: the layout, the descriptor, get_memory (arena.size) and an adopting daemon's arena."""
    gran = cuda_vmm.granularity(DEVICE)
    weights = ProcessedWeights({"a.0.w": torch.ones(1000, 3, dtype=torch.bfloat16, device=DEVICE),
                                "a.1.w": torch.ones(1000, 3, dtype=torch.bfloat16, device=DEVICE)})
    arena = cuda_vmm.VmmFdArena.pack(weights, DEVICE)
    try:
        desc = arena.descriptor()
        assert arena.size == arena.layout.size == arena.alloc.size == desc["size"] == gran
        adopted = cuda_vmm.VmmFdArena.adopt(desc, Layout.from_manifest(manifest(arena.layout), desc["size"]),
                                            os.dup(arena.fd), DEVICE)
        try:
            assert adopted.size == adopted.descriptor()["size"] == arena.size
            assert torch.equal(adopted.tensor()[:6000], arena.tensor()[:6000])
        finally:
            adopted.close()
    finally:
        arena.close()


def test_the_drivers_device_identity_and_arch_are_torchs():
    """core/device.py asks the driver for the UUID and the compute capability (a fresh process's
    cache key was paying for all of torch's device properties): the same answers as torch's."""
    from wcache.core import device

    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        assert device._from_driver(index) == (device.torch_identity(props), f"sm_{props.major}{props.minor}")
    assert device.device_identity("cuda", 0) == device.torch_identity(torch.cuda.get_device_properties(0))
