"""What every weight loader returns, and the interface each ``--load-format`` implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from wcache.core.background import Background
from wcache.core.config import EngineConfig
from wcache.core.postprocess import ProcessedWeights

if TYPE_CHECKING:  # the lease imports the wire; a disk load needs none of it
    from wcache.engine.loading.lease import CacheLease


@dataclass
class LoadReport:
    """How one load went: logged by the engine, printed by the bench."""

    source: str  # "disk" or "the weight cache (zero_copy)" / "the weight cache (copy)"
    seconds: float
    tensors: int
    nbytes: int
    external_bytes: int = 0  # weights held by the daemon and mapped, not owned, by this engine
    fallback_reason: str | None = None
    fallback_kind: str | None = None  # the reason's key in errors.REASONS (a metric's label: a bounded set)
    phases: dict = field(default_factory=dict)  # seconds per handoff step (cache loads only)
    transport: str | None = None  # the arena kind a cache load came through (memfd, cuda_ipc, vmm_fd)
    # copy mode: the thread that lets go of the daemon's memory once the engine has its own copy
    release: Background | None = field(default=None, repr=False, compare=False)


class LoadedWeights(NamedTuple):
    weights: ProcessedWeights
    report: LoadReport
    lease: CacheLease | None = None  # zero_copy: the daemon's memory this engine maps; close() it last

    def settle(self) -> None:
        """Wait for what the load left running in the background (copy mode: the daemon's release)."""
        if self.report.release is not None:
            self.report.release.join()

    def close(self) -> None:
        self.settle()
        if self.lease is not None:
            self.lease.close()


class WeightLoader(ABC):
    """One ``--load-format``. ``draft``: a speculative draft model (the draft daemon group's sockets)."""

    def __init__(self, loader_config=None, draft: bool = False):
        self.loader_config = loader_config
        self.draft = draft

    @abstractmethod
    def load(self, cfg: EngineConfig) -> LoadedWeights:
        """This rank's weights, timed from the call to bindable tensors."""
