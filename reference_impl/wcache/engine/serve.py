"""``wcache serve``'s start-up in one process, for every world size: listen (``/health`` answers 503),
start the other local ranks (worker/supervisor.py), load and size memory on every rank, then serve.

It composes the rooms (the API server, the core and its ranks) and so sits above them all; the
two-process serve (api_server/front.py and core/core_engine.py) composes the same parts across its
two processes.
"""

from __future__ import annotations

import logging
import os

from wcache.core.distributed import exit_after_collectives
from wcache.engine.api_server.settings import ServeSettings
from wcache.engine.core.engine import Engine, rank_specs
from wcache.engine.worker.runner import RankRunner

log = logging.getLogger("wcache.engine")


def run_serve(settings: ServeSettings, loader_config, sock=None, answer_while_loading: bool = True, on_ready=None,
              prepared: RankRunner | None = None, served=None) -> int:
    """``wcache serve``: every world size, one path.

    A ``--respawn`` worker (engine/respawn/spare.py) passes the listening socket its supervisor bound
    (``sock``); a promoted spare leaves clients in the backlog until it is ready
    (``answer_while_loading=False``) and reports readiness with ``on_ready(engine, server)``. A hot
    spare passes the rank it ``prepare``d while waiting (``prepared``), and its ``ServedModel`` (names,
    chat template, API key; 3-4 ms on a 2-core CPU): only its KV cache is left to do.
    """
    from wcache.engine.api_server.served import ServedModel
    from wcache.engine.api_server.server import EngineServer, run_until_signal
    from wcache.engine.worker.supervisor import start_local_ranks

    plan, specs = rank_specs(settings.engine, loader_config)
    # Names, chat template, API key: a bad one stops before loading.
    served = served or ServedModel.from_settings(settings.model, settings.api)
    runner = prepared or RankRunner.from_spec(specs[0])
    if not runner.plain:
        log.info("Engine for data-parallel rank %d: %s; %d rank(s) here, engine world of %d at %s", plan.dp_rank,
                 plan.layout.describe(), len(specs), plan.world_size, plan.init_method)
    server = None
    if plan.drives and answer_while_loading:
        # Listen before loading so /health answers 503 while weights load (readiness probes).
        server = EngineServer.from_settings(settings.http, served, None, sock)
        log.info("Serving on http://%s:%d (health 503 until %s)", settings.http.host, settings.http.port,
                 "weights are loaded" if runner.plain else "every rank has its weights")
        served.log_found()
    supervisor = start_local_ranks(runner, specs, plan, server, runner.finish if prepared is not None else runner.start,
                                   on_fail=server.server_close if server is not None else None)
    engine = Engine(runner, served.tokenizer, served.stop_ids)

    def on_stop() -> None:
        supervisor.stopping = True
        engine.close()
        supervisor.stop()

    if server is None:  # a promoted --respawn spare: clients waited in the backlog until now
        server = EngineServer.from_settings(settings.http, served, engine, sock)
        served.log_found()
    server.engine, server.ready = engine, True
    engine.scheduler.wait_arrived = server.wait_arrived
    server.metrics.engine_ready(engine)
    log.info("Engine ready (pid %d): POST http://%s:%d/v1/completions", os.getpid(), settings.http.host,
             settings.http.port)
    if on_ready is not None:
        on_ready(engine, server)
    run_until_signal(server, on_stop=on_stop)
    code = engine.exit_code()
    log.info("Engine stopped")
    if runner.world.size > 1:
        exit_after_collectives(code)  # past gloo's teardown, which may abort once peers are gone
    return code
