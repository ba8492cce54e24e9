"""`wcache bench` and its sibling measurements, each against real processes (a `wcache preload`
daemon, `wcache serve` engines) that it starts and stops itself.

One module per measurement: handoff.py (weights ready from disk, zero_copy and copy, each sample in a
fresh process), start.py (an engine's whole start to /health 200; timed_serve.py is its engine
side), restart.py (a daemon restart that adopts a running engine's arena, and a standby's takeover),
respawn.py (`wcache bench --respawn`) and streaming.py (concurrent streaming clients, ``python -m
wcache.bench.streaming``). run.py runs `wcache bench`: the first three in one record and its table.
What they share: processes.py (the daemon under test, a process's resident memory), api.py (a free
loopback port, GET /health, one completion), host.py (the machine and code a record measured) and
failure.py (how a measurement fails: with the failed process's last log lines).

Deliberately empty of imports: the command line imports run.py or respawn.py only when asked to.
"""
