"""The completions of one request, one per prompt, submitted to the engine together.

A request's list of prompts (``"prompt": ["a", "b"]``, each ``n`` times: one per choice) gets one
thread per prompt, each calling ``Engine.generate``; an engine that batches runs them in one batch,
one that decodes a sequence at a time runs them one after another. ``stream`` turns their pieces of text into one ordered series of
events for a server-sent stream; a single prompt streams on the request's own thread
(``Engine.pieces``), so each token reaches its socket with one thread wake-up, not two. Both stop
every prompt at its next token once they are told to (a client that went away, a drain's deadline).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator


def _args(req, index: int) -> tuple:
    """Sequence ``index``'s settings: its choice's sampling (each of ``n`` choices seeded apart)."""
    return req.max_tokens, req.choice_sampling(index), req.stop


def _kw(req) -> dict:
    return {"skip_special_tokens": req.skip_special_tokens, **req.stop_rules.as_kwargs()}


def _each_queued(n: int, queued: Callable[[], None] | None) -> Callable[[], None] | None:
    """``queued`` (the HTTP layer's: this request is no longer arriving) once all ``n`` prompts are
    in the engine's queue."""
    if queued is None or n == 1:
        return queued
    left, lock = [n], threading.Lock()

    def one() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            queued()

    return one


def run_all(engine, prompts, req, on_text: Callable[[str], bool] | None = None,
            queued: Callable[[], None] | None = None) -> list:
    """Every prompt's Completion, in the prompts' order; the first failure is raised. ``on_text``
    is told each piece of every prompt's text and returns True to stop them all; ``queued()`` is
    called once every prompt is in the engine's queue."""
    queued = _each_queued(len(prompts), queued)
    if len(prompts) == 1:  # no thread for the usual case
        return [engine.generate(prompts[0], *_args(req, 0), on_text=on_text, queued=queued, **_kw(req))]
    done: list = [None] * len(prompts)
    errors: list[BaseException] = []
    # The first failure (a full queue, as a rule) is the answer: the others stop at their next
    # token, as stream's do. They ran to max_tokens before, n=64 holding the queue for nothing.
    failed = threading.Event()

    def told(piece) -> bool:
        stop = bool(on_text(piece)) if on_text is not None else False
        return stop or failed.is_set()

    def run(i: int) -> None:
        try:
            done[i] = engine.generate(prompts[i], *_args(req, i), on_text=told, queued=queued, **_kw(req))
        except BaseException as e:  # raised below, on the request's thread
            errors.append(e)
            failed.set()

    threads = [threading.Thread(target=run, args=(i,), name=f"wcache-prompt-{i}", daemon=True)
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return done


def _thread(fn, *args) -> None:
    threading.Thread(target=fn, args=args, name="wcache-stream", daemon=True).start()


def stream(engine, prompts, req, stop: Callable[[], bool], submit=_thread,
           queued: Callable[[], None] | None = None) -> Iterator[tuple[str, int, object]]:
    """("text", index, piece) as each piece is decoded, ("done", index, Completion) as each ends,
    until every prompt is done; ("error", index, exception) ends the series early. ``stop()`` is
    asked at each piece: True stops every prompt at its next token. ``submit(fn, *args)`` runs each
    prompt's ``generate`` on another thread (the server's: worker_threads.py); ``queued`` as in
    ``run_all``."""
    queued = _each_queued(len(prompts), queued)
    if len(prompts) == 1:  # the usual case: on this thread, each piece written as it comes
        yield from _stream_one(engine, prompts[0], req, stop, queued)
        return
    events: queue.Queue = queue.Queue()
    failed = threading.Event()

    def run(i: int) -> None:
        try:
            c = engine.generate(prompts[i], *_args(req, i), queued=queued, **_kw(req),
                                on_text=lambda piece: events.put(("text", i, piece)) or failed.is_set() or stop())
            events.put(("done", i, c))
        except BaseException as e:
            events.put(("error", i, e))

    for i in range(len(prompts)):
        submit(run, i)
    left = len(prompts)
    try:
        while left:
            kind, i, item = events.get()
            yield kind, i, item
            if kind == "error":
                return
            left -= kind == "done"
    finally:
        # An error, or a caller that stopped reading (the server returns at an error event without
        # resuming this generator, so a set() after the yield never ran): the others stop at their
        # next token. They ran to max_tokens before, a refused n=64 holding the queue for nothing.
        failed.set()


def _stream_one(engine, prompt, req, stop: Callable[[], bool], queued) -> Iterator[tuple[str, int, object]]:
    pieces = engine.pieces(prompt, *_args(req, 0), queued, **_kw(req))
    try:
        try:
            piece = next(pieces)
            while True:
                yield "text", 0, piece
                piece = pieces.send(stop())
        except StopIteration as done:
            yield "done", 0, done.value
        except Exception as e:  # QueueFull, a failed engine: the caller answers
            yield "error", 0, e
    finally:
        pieces.close()  # a caller that stopped reading: the sequence leaves the batch
