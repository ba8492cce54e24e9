"""The engine (`wcache serve`), in rooms by role, top to bottom (each imports only the rooms below it,
tests/unit/test_layers.py holds it):

- ``respawn/``: ``--respawn``'s supervisor, hot spare and heartbeat;
- ``serve.py``: the start-up in one process, which composes the rooms below;
- ``api_server/``: HTTP, the front door's limits, auth, metrics, the drain; the two-process front;
- ``openai/``: the OpenAI API's requests and answers, chat templates;
- ``core/``: the Engine's step loop and scheduler, each request's text and Completion, the core process;
- ``worker/``: one rank on its device: runner, CUDA graphs, sampling, memory plan, world;
- ``loading/``: how a rank gets its weights (disk, or the daemon's ``ipc_cache``).
"""
