"""One weight-cache daemon rank: load once, pack into an arena, then serve engines over a Unix socket.

Started by the launcher as a fresh interpreter (``python -m wcache.daemon.rank``), never forked: forking
after torch has run a parallel op can deadlock the child. The launcher passes a JSON spec in the
environment and a pipe descriptor on which the rank reports, as one JSON line, that it serves.

Order matters and mirrors upstream: load and post-process, pack, free the transients, and only
then take the lock and bind the socket, so an engine never sees a socket of a daemon that is not
ready. Connections are served on threads; every request is bounded in size and time, and a bad
frame gets an error reply and a closed connection while the daemon keeps serving others.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import torch

from wcache.core import autotune
from wcache import logs
from wcache.daemon import seed
from wcache.core.config import EngineConfig
from wcache.core.device import device_identity
from wcache.core.disk import load_processed
from wcache.errors import (
    DAEMON_ERRORS,
    REASONS,
    AutotuneFailedError,
    UnsupportedQuantForIPCError,
    UserError,
)
from wcache.core.fingerprint import cache_key, checkpoint_digest, mismatched_fields
from wcache.wire.handback import HANDED_BACK_KINDS, take_back
from wcache.wire.protocol import (
    ProtocolError,
    close_fds,
    drain,
    encode,
    recv_frame,
    reply,
    send_frame,
)
from wcache.core.ranks import exit_after_collectives
from wcache.wire.sockets import (
    MAX_SOCKET_PATH,
    DaemonLock,
    bind_private_socket,
    peer_cred,
    prepare_socket_dir,
    socket_name,
)
from wcache.wire.transport import make_arena, manifest, resolve_transport

log = logging.getLogger("wcache.daemon")

MAX_CLIENTS = 256
REQUEST_TIMEOUT_S = 30.0
MODES = ("zero_copy", "copy")
SOCKET_PATH_TOO_LONG = ("Socket path {path} is {n} bytes; Unix sockets allow at most {max}. "
                        "Use a shorter --weight-cache-socket-dir")
MAX_REPORTED_FIELDS = 64  # a mismatch reply names at most this many fields, 128 characters of each
# The daemon's log lines for each refusal (op, error kind, message), and for a request it failed on.
REFUSED_LOG = "Refused request %r from pid %d (%s): %s"
BUSY_LOG = "Refused a connection from pid %d (busy): %s"
SOCKET_NOT_OURS = "Rank %d stopped; left %s alone: it is no longer the socket this daemon bound"
CLIENT_FAILED_LOG = "Connection from pid %d failed; closed it"


class RankDaemon:
    def __init__(self, spec: dict):
        self.spec = spec
        self.cfg = EngineConfig.from_spec(spec)
        ranks = self.cfg.ranks
        self.rank = ranks.global_rank
        self.device_id = device_identity(self.cfg.device, ranks.local_rank)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.released = False
        self.leases: set[int] = set()  # ids of connections holding a zero_copy mapping
        self.clients = threading.BoundedSemaphore(MAX_CLIENTS)
        self.arena = None
        self.autotune_doc = None  # the tuned winners this rank serves to seeding replicas
        self.seed_server = None

    # -- startup -----------------------------------------------------------------------------
    def load(self) -> None:
        if not self.cfg.quant.supports_pre_processed_weights:
            raise UnsupportedQuantForIPCError(self.cfg.quant.name)
        t0 = time.perf_counter()
        digest, stats = checkpoint_digest(self.cfg.model)
        self.key = cache_key(self.cfg, digest)
        from wcache.core.ranks import (
            join_daemon_world,  # one torch.distributed world over all ranks and nodes
        )

        join_daemon_world(self.spec.get("world"), self.cfg.ranks, self.cfg.device, digest)
        adopted = self._take_back() if self.spec.get("adopt", True) else None
        if adopted:
            self.arena, self.aliases, self.attrs = adopted
            self.weights_bytes = self.arena.weights_bytes
        else:
            weights = load_processed(self.cfg, show_progress=self.cfg.ranks.local_rank == 0)
            self.arena = make_arena(weights, self.cfg.torch_device, self.spec.get("transport", "auto"))
            self.aliases, self.attrs = weights.aliases, weights.attrs
            self.weights_bytes = weights.nbytes
            del weights
            gc.collect()  # the post-processed copies are in the arena now; free the transients
            if self.cfg.device == "cuda":
                torch.cuda.empty_cache()  # hand the freed blocks back to the device, not just to torch's pool
        # The answer to get_state never changes: encode it once (10,000 entries take ms to encode).
        self.state_frame = encode(reply(True, arena=self.arena.descriptor(), manifest=manifest(self.arena.layout),
                                        aliases=self.aliases, attrs=self.attrs, device_id=self.device_id,
                                        weights_bytes=self.weights_bytes))
        if adopted:
            return
        log.info("Rank %d loaded %d tensors (%.1f MiB) into a %s arena in %.2f s (hashed %d of %d files)",
                 self.rank, len(self.arena.layout.entries), self.weights_bytes / 2**20, self.arena.kind,
                 time.perf_counter() - t0, stats["files_hashed"], stats["files"])

    def _take_back(self):
        """(arena, aliases, attrs) handed back by a running zero_copy engine (handback.py), or None."""
        kind = resolve_transport(self.spec.get("transport", "auto"), self.cfg.torch_device)
        if kind not in HANDED_BACK_KINDS:
            return None
        return take_back(self.socket_path, self.key, self.device_id, kind, self.cfg.torch_device, self.rank)

    def autotune_pass(self) -> None:
        """Pull the tuned cache from a seed daemon if one is given, then load or tune it (before the
        socket is bound, so an engine that finds the socket also finds the cache). Fatal on failure."""
        if not self.spec.get("autotune", True):
            log.info("[Autotuner]: skipped (--no-enable-autotune)")
            return
        if self.spec.get("draft"):
            log.info("[Autotuner]: skipped for the draft model group")
            return
        try:
            if self.spec.get("seed"):
                seed.pull(self.cfg, self.spec["seed"], self.spec.get("seed_token") or "")
            self.autotune_doc, _path, trials = autotune.load_or_tune(self.cfg, f"daemon rank {self.rank}")
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the pass stops this rank
            raise AutotuneFailedError(e) from e
        log.info(autotune.TRIALS_LINE.format(trials=trials))

    def start_seeding(self) -> None:
        listen = self.spec.get("seed_listen")
        if listen:
            host, base = listen
            self.seed_server = seed.SeedServer(host, base + self.rank, self.spec["seed_token"],
                                               lambda: self.autotune_doc, self.rank).start()

    @functools.cached_property
    def socket_path(self) -> Path:
        """Where this rank serves (its directory made and checked on first use)."""
        if self.spec.get("socket_path"):
            path = Path(self.spec["socket_path"])
            prepare_socket_dir(path.parent, create=True)
            return path
        d = prepare_socket_dir(self.spec.get("socket_dir"), create=True)
        return d / socket_name(self.device_id, self.spec.get("draft", False))

    def bind(self) -> socket.socket:
        path = self.socket_path
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise UserError(SOCKET_PATH_TOO_LONG.format(path=path, n=len(os.fsencode(path)), max=MAX_SOCKET_PATH))
        self.path = path
        self.flock = DaemonLock(path)
        self.flock.acquire()
        if os.path.lexists(path):
            # We own the lock, so whatever is here belongs to a daemon that died: replace it.
            log.warning("Removing stale socket %s left by a previous daemon", path)
            os.unlink(path)
        sock = bind_private_socket(path)
        os.chmod(path, 0o600)
        self.inode = os.lstat(path).st_ino
        sock.listen(128)
        sock.settimeout(0.2)
        return sock

    # -- serving -----------------------------------------------------------------------------
    def serve(self, listener: socket.socket) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self.stop.is_set():
                    break
                log.warning("accept failed: %s", e)
                continue
            if not self.clients.acquire(blocking=False):
                message = DAEMON_ERRORS["busy"].format(max=MAX_CLIENTS)
                log.warning(BUSY_LOG, _peer_pid(conn), message)
                self._refuse(conn, "busy", message)
                continue
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _refuse(self, conn: socket.socket, error: str, message: str, drain_input: bool = False) -> None:
        try:
            conn.settimeout(1.0)
            send_frame(conn, reply(False, error=error, message=message))
            if drain_input:
                drain(conn)
        except OSError:
            pass
        conn.close()

    def _client(self, conn: socket.socket) -> None:
        cid = id(conn)
        pid = -1
        try:
            pid, uid, _gid = peer_cred(conn)
            if uid != os.getuid():
                msg = REASONS["rejected"].format(uid=uid)
                log.warning("%s (pid %d)", msg, pid)
                self._refuse(conn, "rejected", msg, drain_input=True)
                return
            conn.settimeout(REQUEST_TIMEOUT_S)
            while not self.stop.is_set():
                try:
                    req, fds = recv_frame(conn)
                    close_fds(fds)  # clients have no reason to send descriptors; never keep one
                except EOFError:
                    return
                except ProtocolError as e:
                    log.warning("Bad frame from pid %d: %s", pid, e)
                    send_frame(conn, reply(False, error="protocol", message=str(e)))
                    drain(conn)
                    return
                answer, fds = self._handle(cid, req)
                send_frame(conn, answer, fds)
                if isinstance(answer, dict) and not answer["ok"]:
                    log.warning(REFUSED_LOG, str(req.get("op"))[:64], pid, answer["error"], answer["message"])
                    if answer["error"] == "protocol":
                        drain(conn)
                        return
                if cid in self.leases:
                    # A zero_copy lease is this open connection for the engine's whole life: an idle
                    # engine must not lose it to the request timeout (a release would then succeed).
                    conn.settimeout(None)
        except (OSError, TimeoutError):
            pass
        except Exception:  # one connection's failure must never reach the others
            log.exception(CLIENT_FAILED_LOG, pid)
        finally:
            with self.lock:
                self.leases.discard(cid)
            conn.close()
            self.clients.release()

    def _handle(self, cid: int, req: dict) -> tuple[dict, list[int]]:
        op = req.get("op")
        if op == "get_state":
            key, mode = req.get("key"), req.get("mode", "zero_copy")
            if not isinstance(key, dict) or mode not in MODES:
                return reply(False, error="protocol",
                             message=DAEMON_ERRORS["bad_get_state"].format(modes=list(MODES))), []
            with self.lock:
                if self.released:
                    return reply(False, error="released", message=REASONS["released"]), []
                fields = [f[:128] for f in mismatched_fields(self.key, key)[:MAX_REPORTED_FIELDS]]
                if fields:
                    return reply(False, error="mismatch", fields=fields,
                                 message=REASONS["mismatch"].format(fields=fields)), []
                if mode == "zero_copy":
                    self.leases.add(cid)
                return self.state_frame, self.arena.fds()
        if op == "get_memory":
            with self.lock:
                held = 0 if self.released else self.weights_bytes
                return reply(True, weights_bytes=held, arena_bytes=0 if self.released else self.arena.size,
                             released=self.released, zero_copy_engines=len(self.leases)), []
        if op == "release":
            with self.lock:
                others = len(self.leases - {cid})
                if others:
                    return reply(False, error="in_use", message=DAEMON_ERRORS["in_use"].format(n=others)), []
                if not self.released:
                    try:
                        self.arena.close()
                    except Exception as e:  # a driver error must not kill the connection thread silently
                        log.exception("Releasing the cached weights failed")
                        return reply(False, error="release_failed",
                                     message=DAEMON_ERRORS["release_failed"].format(error=e)), []
                    self.released = True
                    log.info("Released the cached weights at an engine's request (copy mode)")
                return reply(True, released=True), []
        return reply(False, error="protocol", message=DAEMON_ERRORS["unknown_op"].format(op=str(op)[:64])), []

    def shutdown(self, listener: socket.socket) -> None:
        listener.close()
        removed = False
        try:
            if os.lstat(self.path).st_ino == self.inode:
                os.unlink(self.path)
                removed = True
        except OSError:
            pass
        self.flock.release()
        if self.seed_server is not None:
            self.seed_server.close()
        if self.arena is not None:
            self.arena.close()
        if removed:
            log.info("Rank %d stopped; socket %s removed", self.rank, self.path)
        else:  # replaced or removed by someone else since we bound it: never unlink what is not ours
            log.warning(SOCKET_NOT_OURS, self.rank, self.path)


def _peer_pid(conn: socket.socket) -> int:
    try:
        return peer_cred(conn)[0]
    except OSError:
        return -1



def main() -> int:
    spec = json.loads(os.environ["WCACHE_RANK_SPEC"])
    logs.setup(spec.get("log_level", "INFO"))
    ready = os.fdopen(spec["ready_fd"], "w")
    daemon = RankDaemon(spec)
    signal.signal(signal.SIGTERM, lambda *_: daemon.stop.set())
    signal.signal(signal.SIGINT, lambda *_: daemon.stop.set())
    try:
        daemon.load()
        daemon.autotune_pass()
        daemon.start_seeding()
        listener = daemon.bind()
    except UserError as e:
        log.error("%s", e)
        return 2
    ready.write(json.dumps({"rank": daemon.rank, "socket": str(daemon.path), "device_id": daemon.device_id,
                            "weights_bytes": daemon.weights_bytes}) + "\n")
    ready.close()
    log.info("Rank %d serving on %s", daemon.rank, daemon.path)
    try:
        daemon.serve(listener)
    finally:
        daemon.shutdown(listener)
    return 0


if __name__ == "__main__":
    # A rank that joined a multi-node world must skip gloo's teardown (see exit_after_collectives),
    # also when it exits 2 because the nodes' checkpoints differ.
    exit_after_collectives(main())
