"""`wcache serve`'s settings, whole: the engine core's (engine/core/settings.py), what the API answers
to (``ApiSettings``: served.py reads them) and the HTTP server's (``HttpSettings``: server.py), built
once from the command line (cli/, core/settings.py's from_flags).

``run_serve``, the two-process front and ``--respawn``'s supervisor and workers take ``ServeSettings``;
the last two get it as JSON (core/settings.py's to_data and from_data). Light on purpose: the
supervisor imports it after its exec, where torch and the HTTP server are never loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The drain's, the failover policy's and the template sandbox's modules: the standard library only.
from wcache.engine.api_server.drain import SHUTDOWN_DELAY_S, SHUTDOWN_TIMEOUT_S
from wcache.engine.core.failover_policy import HEARTBEAT_TIMEOUT_S
from wcache.engine.core.settings import CoreSettings, EngineSettings
from wcache.engine.openai.template_sandbox import DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class ApiSettings:
    """What the API answers to (add_api_args in cli/flags.py): names, tokenizer, stop ids, chat
    template, API keys."""

    served_model_name: tuple[str, ...] | None = None
    chat_template: str | None = None
    api_key: tuple[str, ...] | None = field(default=None, repr=False)  # never in a log line
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    generation_config: str = "auto"
    chat_template_render_timeout: float = DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class HttpSettings:
    """Where the HTTP server listens and how it runs and stops (add_serve_args' --host and --port,
    add_http_args)."""

    host: str = "0.0.0.0"
    port: int = 8000
    max_concurrent_connections: int = 64  # http_front.Limits().max_connections (not imported: see above)
    disable_log_requests: bool = False
    shutdown_delay: float = SHUTDOWN_DELAY_S
    shutdown_timeout: float = SHUTDOWN_TIMEOUT_S


@dataclass(frozen=True)
class ServeSettings:
    """Every flag of `wcache serve`, typed."""

    core: CoreSettings
    api: ApiSettings = field(default_factory=ApiSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    respawn_heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S

    @property
    def engine(self) -> EngineSettings:
        return self.core.engine

    @property
    def model(self) -> str:
        return self.core.engine.model
