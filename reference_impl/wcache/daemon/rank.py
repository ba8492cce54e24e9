"""One weight-cache daemon rank: load once, pack into an arena, then serve engines over a Unix socket.

Started by the launcher as a fresh interpreter (``python -m wcache.daemon.rank``), never forked: forking
after torch has run a parallel op can deadlock the child. The launcher passes a JSON spec in the
environment and a pipe descriptor on which the rank reports, as one JSON line, that it serves.

Order matters. The lock comes first (the launcher takes it before starting the rank): a second daemon for the
device stops before it reads a weight, writes a record or touches the device. Then, as upstream: load and
post-process, pack, free the transients, and only then bind the socket, so an engine never sees a socket of a
daemon that is not ready. Connections are served on threads; every request is bounded in size, shape and total
time (protocol.recv_frame), all requests together in bytes held (FrameBudget), every connection to one unread
answer carrying a descriptor, and the daemon's descriptor table so that clients can never fill it
(fd_reserve). A bad frame gets an error reply and a closed connection while the daemon keeps serving others.
"""

from __future__ import annotations

import errno
import functools
import gc
import json
import fcntl
import logging
import os
import resource
import signal
import socket
import threading
import time
from pathlib import Path

import torch

from wcache.core import autotune, no_dump
from wcache import logs
from wcache.daemon import ENTERED, arena_record, prewarm, seed
from wcache.daemon.lifeline import die_with_parent
from wcache.daemon.metrics import RankMetrics
from wcache.model.quant import refuse_for_cache
from wcache.core.config import EngineConfig
from wcache.core.device import device_identity
from wcache.core.disk import load_processed
from wcache.core.stop_flag import StopFlag
from wcache.errors import DAEMON_ERRORS, REASONS, STALE_SOCKET_REMOVED, AutotuneFailedError, UserError
from wcache.core.fingerprint import cache_key, checkpoint_digest, mismatched_fields
from wcache.wire.handback import HANDED_BACK_KINDS, take_back
from wcache.wire.protocol import (
    MAX_FDS,
    REQUESTS,
    BudgetExceeded,
    FrameBudget,
    ProtocolError,
    close_fds,
    drain,
    encode,
    recv_frame,
    reply,
    send_frame,
)
from wcache.core.distributed import exit_after_collectives
from wcache.wire.sockets import (
    MAX_SOCKET_PATH,
    DaemonLock,
    bind_private_socket,
    claim_socket,
    clear_stale_socket,
    peer_cred,
    prepare_socket_dir,
    socket_path_for,
)
from wcache.wire.arena import manifest
from wcache.wire.arenas import make_arena
from wcache.wire.transports.auto import resolve_transport
from wcache.daemon.weight_pull import load_weights  # weights from a seed daemon or the disk
from wcache.daemon.weight_source import WeightSource
from wcache.wire import handback

log = logging.getLogger("wcache.daemon")

# When each start-up step ended (time.monotonic, one clock for every process of the host); main()
# logs the steps' seconds as START_PHASES once the rank serves, for `wcache bench` (bench/restart.py).
MARKS: dict[str, float] = {}
START_PHASES = "Rank {rank} start phases (s): {phases}"

# A rank that took over from a stopped daemon (a standby: launcher.py) holds its lock the moment
# the old daemon dies, while its engines notice the hang-up and bind their hand-back offers a few
# ms later (handback.ArenaOffer). Loading from disk instead of waiting would hold the weights twice
# and cost the whole load; so such a rank, if it recorded an arena, waits this long for an offer for
# its socket, stopping as soon as one answers. Generous against a busy host; paid in full only when
# no engine maps the arena any more.
OFFER_AFTER_TAKEOVER_S = 2.0
MAX_CLIENTS = 256
REQUEST_TIMEOUT_S = 30.0  # waiting for a request, and then for all of its bytes (not per recv)
# Requests are small: a key of 16 fields. These bound what one can parse into.
REQUEST_CONTAINERS = 4096
REQUEST_ITEMS = 65_536
IN_FLIGHT_BYTES = 128 << 20  # request bytes (x4 for what parsing makes of them) of all connections at once
FD_RESERVE = 64  # descriptors kept free of clients: arena, logs, the seed listener, the driver
ACCEPT_BACKOFF_S = (0.05, 1.0)  # after EMFILE/ENFILE: first and longest pause before accepting again
EMFILE_LOG_EVERY_S = 10.0
MODES = ("zero_copy", "copy")
SOCKET_PATH_TOO_LONG = ("Socket path {path} is {n} bytes; Unix sockets allow at most {max}. "
                        "Use a shorter --weight-cache-socket-dir")
MAX_REPORTED_FIELDS = 64  # a mismatch reply names at most this many fields, 128 characters of each
# The daemon's log lines for each refusal (op, error kind, message), and for a request it failed on.
REFUSED_LOG = "Refused request %r from pid %d (%s): %s"
BUSY_LOG = "Refused a connection from pid %d (busy): %s"
SOCKET_NOT_OURS = "Rank %d stopped; left %s alone: it is no longer the socket this daemon bound"
CLIENT_FAILED_LOG = "Connection from pid %d failed; closed it"
CLIENT_IO_LOG = "Connection from pid %d closed: %s"
ACCEPT_FAILED_LOG = "Cannot accept connections (%s); pausing %.2f s (%d such errors in the last %.0f s)"
UNREAD_LOG = "Closed the connection of pid %d: it has not read the answer carrying a descriptor (%d bytes unread)"
STOPPED_STARTING = "Rank %d stopped by %s while starting"
CLIENT_LIMIT_LOG = "Serving at most %d connections at once: the descriptor limit is %d"


class RankDaemon:
    def __init__(self, spec: dict):
        self.spec = spec
        self.cfg = EngineConfig.from_spec(spec)
        ranks = self.cfg.ranks
        self.rank = ranks.global_rank
        self.device_id = device_identity(self.cfg.device, ranks.local_rank)
        self.stop = StopFlag()  # set by the SIGTERM handler: no lock (core/stop_flag.py)
        self.lock = threading.Lock()
        self.released = False
        self.leases: set[int] = set()  # ids of connections holding a zero_copy mapping
        self.max_clients = client_limit()
        self.clients = threading.BoundedSemaphore(self.max_clients)
        self.budget = FrameBudget(IN_FLIGHT_BYTES)
        self.arena = None
        self.recording: threading.Thread | None = None  # hashes a GPU arena for its record; joined before it is freed
        self.autotune_doc = None  # the tuned winners this rank serves to seeding replicas
        self.seed_server = None
        self.metrics = RankMetrics(spec, self.rank, self.device_id)  # built once serving (metrics.py)

    # -- startup -----------------------------------------------------------------------------
    def load(self) -> None:
        refuse_for_cache(self.cfg.quant)
        t0 = time.perf_counter()
        digest, stats = checkpoint_digest(self.cfg.model, rehash=self.spec.get("rehash", False), entries=(files := {}))
        self.key = cache_key(self.cfg, digest)
        self.shards = {n: e for n, e in files.items() if n != "config.json"}  # what seeded replicas are sent
        MARKS["key"] = time.monotonic()
        from wcache.core.distributed import (
            join_daemon_world,  # one torch.distributed world over all ranks and nodes
        )

        join_daemon_world(self.spec.get("world"), self.cfg.ranks, self.cfg.device, digest)
        adopted = self._take_back() if self.spec.get("adopt", True) else None
        MARKS["adopt"] = time.monotonic()
        MARKS["adopted"] = bool(adopted)
        if adopted:
            self.arena, self.aliases, self.attrs = adopted
            self.weights_bytes = self.arena.weights_bytes
        else:
            weights = load_processed(self.cfg, show_progress=self.cfg.ranks.local_rank == 0)
            self.arena = make_arena(weights, self.cfg.torch_device, self.spec.get("transport", "auto"))
            self.aliases, self.attrs = weights.aliases, weights.attrs
            self.weights_bytes = weights.nbytes
            if self.spec.get("adopt", True):  # what a restarted daemon may adopt: this arena only
                self._record()
            del weights
            gc.collect()  # the post-processed copies are in the arena now; free the transients
            if self.cfg.device == "cuda":
                torch.cuda.empty_cache()  # hand the freed blocks back to the device, not just to torch's pool
        self._encode_state()
        if adopted:
            return
        log.info("Rank %d loaded %d tensors (%.1f MiB) into a %s arena in %.2f s (hashed %d of %d files)",
                 self.rank, len(self.arena.layout.entries), self.weights_bytes / 2**20, self.arena.kind,
                 time.perf_counter() - t0, stats["files_hashed"], stats["files"])

    def _encode_state(self) -> None:
        # The answer to get_state never changes: encode it once (10,000 entries take ms to encode).
        self.state_frame = encode(reply(True, arena=self.arena.descriptor(), manifest=manifest(self.arena.layout),
                                        aliases=self.aliases, attrs=self.attrs, device_id=self.device_id,
                                        weights_bytes=self.weights_bytes))

    def take_seeded(self, seeded) -> None:
        """Serve an arena seeded from another daemon (weight_pull.py) instead of loading one."""
        MARKS["key"] = MARKS["adopt"] = time.monotonic()
        self.key, self.shards, self.arena = seeded.key, seeded.shards, seeded.arena
        self.aliases, self.attrs, self.weights_bytes = seeded.aliases, seeded.attrs, seeded.weights_bytes
        self._encode_state()
        if self.spec.get("adopt", True):
            self._record()

    def _record(self) -> None:
        """Write what a restarted daemon may adopt: this arena, with everything served with it."""
        served = {"key": self.key, "device_id": self.device_id, "manifest": manifest(self.arena.layout),
                  "aliases": self.aliases, "attrs": self.attrs, "weights_bytes": self.weights_bytes}
        args = (self.socket_path, self.arena, served, self.rank)
        if self.arena.kind == "memfd":  # an fstat: at once
            arena_record.write(*args)
        else:  # hashing GPU memory: not on the way to serving
            self.recording = threading.Thread(target=arena_record.write, args=args, name="wcache-arena-record",
                                              daemon=True)
            self.recording.start()

    def _take_back(self):
        """(arena, aliases, attrs) handed back by a running zero_copy engine (handback.py), or None."""
        kind = resolve_transport(self.spec.get("transport", "auto"), self.cfg.torch_device)
        if kind not in HANDED_BACK_KINDS:
            return None
        record = arena_record.Record(self.socket_path, self.rank, self.key, self.device_id, kind)
        return take_back(self.socket_path, self.key, self.device_id, kind, self.cfg.torch_device, self.rank,
                         record=record, wait_s=OFFER_AFTER_TAKEOVER_S if self.spec.get("took_over") else 0.0)

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
            served = {"manifest": manifest(self.arena.layout), "aliases": self.aliases, "attrs": self.attrs,
                      "weights_bytes": self.weights_bytes}
            rounds = (self.spec.get("seed_window_s"), self.spec.get("seed_round_replicas"))  # window, expected
            weights = WeightSource(self.rank, self.key, self.cfg.model, self.shards, served,
                                   lambda: None if self.released else self.arena, *rounds)
            self.seed_server = seed.SeedServer(host, base + self.rank, self.spec["seed_token"],
                                               lambda: self.autotune_doc, self.rank, self.metrics.seed_answer,
                                               weights=weights).start()

    @functools.cached_property
    def socket_path(self) -> Path:
        """Where this rank serves (its directory made and checked on first use)."""
        if self.spec.get("socket_path"):
            path = Path(self.spec["socket_path"])
            prepare_socket_dir(path.parent, create=True)
            return path
        d = prepare_socket_dir(self.spec.get("socket_dir"), create=True)
        return socket_path_for(d, self.device_id, self.spec.get("draft", False))

    def claim(self) -> None:
        """Take this rank's lock (or confirm the one the launcher took for it) before anything
        else: a second daemon for the device stops here, having read no weights, written no
        record, tuned nothing and allocated nothing on the device."""
        path = self.socket_path
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise UserError(SOCKET_PATH_TOO_LONG.format(path=path, n=len(os.fsencode(path)), max=MAX_SOCKET_PATH))
        self.path = path
        fd = self.spec.get("lock_fd")
        self.flock = claim_socket(path, DaemonLock.inherited(path, fd) if fd is not None else None)

    def bind(self) -> socket.socket:
        """Bind the socket, once ready to serve. The lock is ours since claim(); a file that
        appeared at the path since then is removed only if it is provably stale."""
        path = self.path
        if clear_stale_socket(path):
            log.warning(STALE_SOCKET_REMOVED.format(path=path))
        sock = bind_private_socket(path)
        os.chmod(path, 0o600)
        self.inode = os.lstat(path).st_ino
        sock.listen(128)
        sock.settimeout(0.2)
        return sock

    # -- serving -----------------------------------------------------------------------------
    def serve(self, listener: socket.socket) -> None:
        pause, errors, logged = 0.0, 0, 0.0
        while not self.stop.is_set():
            try:
                conn, _ = listener.accept()
                pause = 0.0
            except TimeoutError:
                continue
            except OSError as e:
                if self.stop.is_set():
                    break
                # Out of descriptors (EMFILE/ENFILE) or memory: accepting again at once fails again
                # and spins. Pause, doubling up to a second, and log once per EMFILE_LOG_EVERY_S.
                errors += 1
                pause = min(ACCEPT_BACKOFF_S[1], max(ACCEPT_BACKOFF_S[0], pause * 2))
                now = time.monotonic()
                if now - logged >= EMFILE_LOG_EVERY_S:
                    log.warning(ACCEPT_FAILED_LOG, e, pause, errors, EMFILE_LOG_EVERY_S)
                    logged, errors = now, 0
                self.stop.wait(pause)
                continue
            if not self.clients.acquire(blocking=False):
                message = DAEMON_ERRORS["busy"].format(max=self.max_clients)
                log.warning(BUSY_LOG, _peer_pid(conn), message)
                self._refuse(conn, "busy", message)
                continue
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _refuse(self, conn: socket.socket, error: str, message: str, drain_input: bool = False) -> None:
        self.metrics.refused(error)
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
                    req, fds = recv_frame(conn, timeout=REQUEST_TIMEOUT_S, budget=self.budget,
                                          max_containers=REQUEST_CONTAINERS, max_items=REQUEST_ITEMS)
                    close_fds(fds)  # clients have no reason to send descriptors; never keep one
                except EOFError:
                    return
                except BudgetExceeded as e:
                    self._refuse(conn, "busy", DAEMON_ERRORS["busy_bytes"].format(held=e.held, limit=e.limit),
                                 drain_input=True)
                    log.warning(REFUSED_LOG, "?", pid, "busy", e)
                    return
                except ProtocolError as e:
                    log.warning("Bad frame from pid %d: %s", pid, e)
                    self.metrics.refused("protocol")
                    send_frame(conn, reply(False, error="protocol", message=str(e)))
                    drain(conn)
                    return
                try:
                    op = str(req.get("op"))[:64]
                    mode = req.get("mode", "zero_copy")
                    answer, fds = self._handle(cid, req)
                finally:
                    del req  # a parsed request is never kept while the connection idles
                    self.budget.release()
                if fds and (unread := _unread_bytes(conn)):
                    # Its earlier answer, and the descriptor riding on it, are still in flight:
                    # a peer that never reads would pile descriptors up until the kernel refuses
                    # to send any (engines then get nothing). One unread answer per connection.
                    log.warning(UNREAD_LOG, pid, unread)
                    self._refuse(conn, "unread", DAEMON_ERRORS["unread"], drain_input=True)
                    return
                if not fds:
                    send_frame(conn, answer)
                elif not self._send_descriptors(conn, cid, pid, op, answer, fds):
                    continue
                if fds and op == "get_state":
                    self.metrics.handoff(mode)
                if isinstance(answer, dict) and not answer["ok"]:
                    self.metrics.refused(answer["error"])
                    log.warning(REFUSED_LOG, op, pid, answer["error"], answer["message"])
                    if answer["error"] == "protocol":
                        drain(conn)
                        return
                if cid in self.leases:
                    # A zero_copy lease is this open connection for the engine's whole life: an idle
                    # engine must not lose it to the request timeout (a release would then succeed).
                    conn.settimeout(None)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            pass  # the client went away: nothing to tell anyone
        except (OSError, TimeoutError) as e:  # e.g. ETOOMANYREFS on a descriptor, a request too slow
            log.warning(CLIENT_IO_LOG, pid, e)
        except Exception:  # one connection's failure must never reach the others
            log.exception(CLIENT_FAILED_LOG, pid)
        finally:
            with self.lock:
                self.leases.discard(cid)
            conn.close()
            self.clients.release()

    def _send_descriptors(self, conn: socket.socket, cid: int, pid: int, op: str, answer, fds: list[int]) -> bool:
        """Send an answer that carries the arena's descriptors; False when the kernel refused to pass
        them for this user (ETOOMANYREFS). The engine then gets a refusal that names the cause, and
        this connection, like every other, stays served."""
        try:
            send_frame(conn, answer, fds)
            return True
        except OSError as e:
            if e.errno != errno.ETOOMANYREFS:
                raise
        with self.lock:
            self.leases.discard(cid)  # it never got the mapping
        message = DAEMON_ERRORS["fds_in_flight"].format(uid=os.getuid(), limit=_fd_limit())
        self.metrics.refused("fds_in_flight")
        log.warning(REFUSED_LOG, op, pid, "fds_in_flight", message)
        send_frame(conn, reply(False, error="fds_in_flight", message=message))
        return False

    def _handle(self, cid: int, req: dict) -> tuple[dict, list[int]]:
        handler = self.HANDLERS.get(req.get("op")) if isinstance(req.get("op"), str) else None
        if handler is None:
            op = req.get("op")
            return reply(False, error="protocol", message=DAEMON_ERRORS["unknown_op"].format(op=str(op)[:64])), []
        return handler(self, cid, req)

    def _get_state(self, cid: int, req: dict) -> tuple[dict, list[int]]:
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

    def _get_memory(self, cid: int, req: dict) -> tuple[dict, list[int]]:
        with self.lock:
            held = 0 if self.released else self.weights_bytes
            return reply(True, weights_bytes=held, arena_bytes=0 if self.released else self.arena.size,
                         released=self.released, zero_copy_engines=len(self.leases)), []

    def _release(self, cid: int, req: dict) -> tuple[dict, list[int]]:
        with self.lock:
            others = len(self.leases - {cid})
            if others:
                return reply(False, error="in_use", message=DAEMON_ERRORS["in_use"].format(n=others)), []
            if not self.released:
                try:
                    if self.recording is not None:
                        self.recording.join()  # it reads the arena: never free memory under it
                    self.arena.close()
                except Exception as e:  # a driver error must not kill the connection thread silently
                    log.exception("Releasing the cached weights failed")
                    return reply(False, error="release_failed",
                                 message=DAEMON_ERRORS["release_failed"].format(error=e)), []
                self.released = True
                self.metrics.weights(0)
                log.info("Released the cached weights at an engine's request (copy mode)")
            return reply(True, released=True), []

    # The protocol's op table (protocol.REQUESTS) is what the daemon dispatches on: one handler each.
    HANDLERS = {"get_state": _get_state, "get_memory": _get_memory, "release": _release}
    assert tuple(HANDLERS) == REQUESTS, "every request of protocol.REQUESTS needs its handler, and no other"

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
            if self.recording is not None:
                self.recording.join()
            self.arena.close()
        if removed:
            log.info("Rank %d stopped; socket %s removed", self.rank, self.path)
        else:  # replaced or removed by someone else since we bound it: never unlink what is not ours
            log.warning(SOCKET_NOT_OURS, self.rank, self.path)


def _unread_bytes(conn: socket.socket) -> int:
    """Bytes this side sent that the peer has not read yet (SIOCOUTQ, the same request as TIOCOUTQ)."""
    try:
        import termios

        return int.from_bytes(fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"), "little", signed=True)
    except OSError:
        return 0


def client_limit() -> int:
    """Connections served at once: MAX_CLIENTS, or fewer where the descriptor limit could not hold
    each with its own socket and MAX_FDS received descriptors, besides FD_RESERVE. The soft limit
    is raised to the hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_CLIENTS * (1 + MAX_FDS) + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= want:
        return MAX_CLIENTS
    n = max(1, (soft - FD_RESERVE) // (1 + MAX_FDS))
    log.warning(CLIENT_LIMIT_LOG, n, soft)
    return n


def _fd_limit() -> int:
    """This process's RLIMIT_NOFILE: the kernel's bound on its user's descriptors in flight."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _peer_pid(conn: socket.socket) -> int:
    try:
        return peer_cred(conn)[0]
    except OSError:
        return -1


def start_phases(spec: dict) -> dict:
    """Seconds of each start-up step, from the launcher's spawn of this rank to now (serving)."""
    now = time.monotonic()
    taken = {k: handback.TIMINGS.get(k, 0.0) for k in ("import_arena", "verify")} if MARKS.get("adopted") else {}
    imported, verified = taken.get("import_arena", 0.0), taken.get("verify", 0.0)
    phases = {"interpreter": ENTERED - spec.get("spawned_at", ENTERED), "imports": MARKS["imported"] - ENTERED,
              "spec_wait": MARKS["spec"] - MARKS["imported"],  # a prewarmed rank waiting for the launcher's plan
              "cuda_context": MARKS["cuda_context"] - MARKS["init"],  # its configuration before it: in "other"
              "key": MARKS["key"] - MARKS["cuda_context"],
              "offers": MARKS["adopt"] - MARKS["key"] - imported - verified,  # finding and asking them, the world
              "import_arena": imported, "verify": verified,
              "load": MARKS["loaded"] - MARKS["adopt"],  # from disk and packing, unless adopted
              "autotune": MARKS["autotuned"] - MARKS["loaded"]}
    phases["other"] = now - spec.get("spawned_at", ENTERED) - sum(phases.values())
    return {"spawned_at": spec.get("spawned_at"), "ready_at": now, **{k: round(v, 4) for k, v in phases.items()}}


def main() -> int:
    no_dump.forbid()  # the weights, the socket and the arena's memfd: see core/no_dump.py
    MARKS["imported"] = time.monotonic()
    spec = prewarm.read_spec()  # a prewarmed rank waits here for the launcher's plan
    if spec is None:
        return 0  # started ahead of the launcher's plan, which did not need it
    MARKS["spec"] = time.monotonic()
    logs.setup(spec.get("log_level", "INFO"))
    ready = os.fdopen(spec["ready_fd"], "w")
    daemon = RankDaemon(spec)
    serving = threading.Event()

    def on_stop(signum, _frame):
        daemon.stop.set()
        if not serving.is_set():  # still starting: nothing bound or handed out, so leave at once
            log.info(STOPPED_STARTING, daemon.rank, signal.Signals(signum).name)
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    if spec.get("parent_pid") is not None:
        die_with_parent(spec["parent_pid"])
    try:
        daemon.claim()  # lock first: nothing below runs for a device another daemon owns
        MARKS["init"] = time.monotonic()  # configured and locked: what came before it counts as "other"
        if daemon.cfg.device == "cuda":  # its own step: otherwise the first CUDA call pays it inside another
            torch.empty(1, device=daemon.cfg.torch_device)
            torch.cuda.synchronize(daemon.cfg.torch_device)
        MARKS["cuda_context"] = time.monotonic()
        load_weights(daemon)  # from a seed daemon (--weight-cache-seed) or the disk
        MARKS["loaded"] = time.monotonic()
        daemon.autotune_pass()
        MARKS["autotuned"] = time.monotonic()
        daemon.start_seeding()
        listener = daemon.bind()
    except UserError as e:
        log.error("%s", e)
        return 2
    # Logged before the launcher hears of it: whoever reads READY (the bench, `wcache wait --log`)
    # finds the phases and the serving line already above it, never after.
    log.info(START_PHASES.format(rank=daemon.rank, phases=json.dumps(start_phases(spec))))
    log.info("Rank %d serving on %s", daemon.rank, daemon.path)
    ready.write(json.dumps({"rank": daemon.rank, "socket": str(daemon.path), "device_id": daemon.device_id,
                            "weights_bytes": daemon.weights_bytes}) + "\n")
    ready.close()
    serving.set()
    daemon.metrics.serving(daemon.weights_bytes, adopted=bool(MARKS.get("adopted")))
    try:
        daemon.serve(listener)
    finally:
        daemon.shutdown(listener)
    return 0


if __name__ == "__main__":
    # A rank that joined a multi-node world must skip gloo's teardown (see exit_after_collectives),
    # also when it exits 2 because the nodes' checkpoints differ.
    exit_after_collectives(main())
