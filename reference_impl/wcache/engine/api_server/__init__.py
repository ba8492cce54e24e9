"""The API server: the HTTP server every client talks to, and what a request costs before a route sees it.

Owns: the server and its routes (server.py), the front door's limits and deadlines (http_front.py), its
threads (worker_threads.py), the API key (auth.py), request ids and the access log, ``/metrics`` (metrics.py),
``/version``, a client that went away (client_gone.py), SIGTERM's drain (drain.py), what is served, settled
before the weights load (served.py), and, for the two-process serve, the front process (front.py) with its
client of the engine core (core_client.py), which imports no torch.
May import: the rooms below it (openai, core, worker, loading), wcache's core, wire and model, errors, logs.
The rooms below never import it (tests/unit/test_layers.py).
"""
