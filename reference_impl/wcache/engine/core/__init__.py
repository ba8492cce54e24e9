"""The engine core: continuous batching over the ranks, one step at a time, and what each request gets back.

Owns: the Engine and its step loop (engine.py), the scheduler's queue and batch (scheduler.py), where a step's
time goes (step_clock.py), a completion's text as its tokens arrive, with stop strings (textstream.py), the
Completion and the loop that reads a request's tokens (completion.py), the engine's settings (settings.py),
and, for the two-process serve, the core process (core_proc.py, core_engine.py) and the messages it exchanges
with the front (core_messages.py).
May import: the rooms below it (worker, loading), wcache's core, wire and model, errors, logs. Not the API
server or the API: they call the core, never the other way.
"""
