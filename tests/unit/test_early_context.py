"""Which `wcache serve` command lines start making a CUDA context while the engine imports."""

from __future__ import annotations

import pytest
from wcache.engine.worker import early_context


@pytest.mark.parametrize("argv, wanted", [
    (["serve", "m", "--device", "cuda"], True),
    (["serve", "m", "--device=cuda"], True),
    (["serve", "m", "--device", "cpu"], False),
    (["serve", "m", "--device", "cuda", "--respawn"], False),  # the supervisor: its workers make their own
    (["serve", "m", "--device", "cuda", "--help"], False),
])
def test_the_command_line_decides(argv, wanted):
    assert early_context.wants_cuda(argv) is wanted


def test_auto_follows_the_installed_torch():
    # --device auto (the default) picks CUDA only with a CUDA build of torch: here, the build installed.
    import torch

    built_with_cuda = torch.version.cuda is not None
    assert early_context.wants_cuda(["serve", "m"]) is built_with_cuda
    assert early_context.wants_cuda(["serve", "m", "--device", "auto"]) is built_with_cuda
