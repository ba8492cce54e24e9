"""The scheduler keeps the running slots packed at the bottom (scheduler.compact): a GPU decodes the
slots up to the last running one, so holes left by finished sequences cost rows until filled. The
keys move with their sequence (runner.move_slot); tests/integration/test_batching.py proves a moved
sequence keeps its tokens."""

from __future__ import annotations

from wcache.engine.worker.sampling import GREEDY, Sampler
from wcache.engine.core.scheduler import Scheduler, Sequence


def running(n: int, slots: int) -> tuple[Scheduler, list[Sequence]]:
    sched = Scheduler(slots, 100)
    seqs = [Sequence([1, 2, 3], 8, Sampler(GREEDY), None) for _ in range(n)]
    for s in seqs:
        sched.add(s)
    step = sched.next_step(1.0)
    assert [s.slot for s in step.joining] == list(range(n))
    return sched, seqs


def test_the_highest_running_sequences_move_down_into_the_holes():
    sched, seqs = running(6, 8)
    for s in (seqs[1], seqs[3]):
        sched.finish(s)
    moves = sched.compact()
    assert [(seqs.index(s), old, new) for s, old, new in moves] == [(5, 5, 1), (4, 4, 3)]
    assert sorted(s.slot for s in sched.running) == [0, 1, 2, 3]
    assert sched.compact() == []  # packed: nothing moves
    late = Sequence([1], 4, Sampler(GREEDY), None)
    sched.add(late)
    assert sched.next_step(1.0).joining == [late] and late.slot == 4  # the lowest free slot


def test_nothing_moves_when_the_holes_are_above_every_running_sequence():
    sched, seqs = running(4, 8)
    sched.finish(seqs[3])
    assert sched.compact() == []
    assert [s.slot for s in seqs[:3]] == [0, 1, 2]
