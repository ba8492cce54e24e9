"""``wcache serve --respawn``: a supervisor that keeps the socket, one serving worker and a hot spare.

Owns: the supervisor (respawn.py, which imports neither torch nor the model at module level), the spare's start
and promotion (spare.py), the serving worker's heartbeat (heartbeat.py), the supervisor's front desk that
reads each request (reception.py) and the descriptor handoff between them (handoff.py, handed.py).
May import: every room below it (a promoted spare runs a whole engine: api_server, openai, core, worker,
loading) and the start-up its promoted spare runs (engine/serve.py), wcache's core, wire and model, errors,
logs. Only the CLI imports it.
"""
