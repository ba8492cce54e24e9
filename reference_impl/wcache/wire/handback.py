"""Hand the arena back: a restarted daemon takes the weights from a running zero_copy engine.

When a daemon dies, every ``zero_copy`` engine still maps its arena, and for a memfd or a CUDA VMM
allocation the engine's mapping keeps that memory alive. The engine also kept one descriptor of
the arena. So instead of reading the checkpoint again, the next daemon can serve that memory:

1. Engine: its lease connection hangs up. It keeps serving from the memory it maps, and offers
   the arena on a Unix socket in the daemon's socket directory, ``wcache_offer_<random>.sock``
   (mode 0600, so it works across containers that share the directory). The name never depends
   on the device: a GPU UUID makes the daemon's own name long, and the offer's must still fit
   the 107 bytes of a Unix socket path wherever the daemon's fits.
2. Daemon: after hashing the checkpoint and before loading it, it asks every offer in the
   directory, at once and within ASK_BUDGET_S in all, for the arena of its own socket name. The
   engine of that socket (same uid) answers with the arena's descriptor, manifest, aliases and
   attributes and passes the descriptor (SCM_RIGHTS); others say it is not theirs. Any process
   that reaches the directory can plant an offer, so the daemon takes nothing but the descriptor:
   it serves it only as the arena its own record (daemon/arena_record.py, in its state directory)
   says it packed for its current checkpoint, key, device, rank and transport, with the record's
   layout, aliases and attributes, and only once the bytes check out against the record (memfd:
   seals and inode identity; vmm_fd: a keyed hash on the GPU). Anything else is logged and it
   loads from disk.
3. Engine: it re-leases from the daemon that now serves the same arena (same arena id), and
   removes its offer. If the new daemon loaded its own copy instead, the engine keeps its memory,
   stops offering and says so.

Legacy CUDA IPC cannot be handed back: its handle names the exporting process, which is gone.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import select
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from wcache.core.background import Background
from wcache.errors import (
    ADOPTED,
    HANDED_BACK,
    LEASE_LOST,
    LEASED_AGAIN,
    NO_OFFER,
    NO_OFFER_AFTER_TAKEOVER,
    OFFER_SKIPPED,
    OTHER_COPY,
    OWN_COPY,
    STALE_OFFER,
    CacheUnusable,
)
from wcache.core.fingerprint import mismatched_fields
from wcache.wire.protocol import ProtocolError, close_fds, recv_frame, reply, request, send_frame
from wcache.wire.sockets import MAX_SOCKET_PATH, bind_private_socket, check_socket_file, peer_cred
from wcache.wire.arena import Layout
from wcache.wire.arenas import HANDED_BACK_KINDS, adopt_arena  # noqa: F401  (rank.py imports HANDED_BACK_KINDS here)

log = logging.getLogger("wcache.handback")

OFFER_PREFIX = "wcache_offer_"  # + 16 hex + ".sock": 34 bytes, shorter than any daemon socket's name
ASK_TIMEOUT_S = 5.0  # an engine answers at once; a hung one must not stall a daemon's start for long
ASK_BUDGET_S = 5.0  # all offers are asked at once, and all together within this
TIMINGS: dict[str, float] = {}  # seconds of the last adoption's import and verification (the daemon's start phases)
MAX_OFFERS = 64  # offers asked per start; more is a flood, not engines
NOT_THIS_SOCKET = "not_this_socket"
RELEASE_POLL_S = 0.25
OFFER_POLL_S = 0.02  # a daemon waiting for offers (take_back's wait_s) looks at the directory this often



# -- engine side ------------------------------------------------------------------------------
# The offer sockets this process has bound, for withdraw_offers(); None once it ran (no new offers).
_offered: set[Path] | None = set()
_offered_lock = threading.Lock()


def withdraw_offers() -> None:
    """Remove every offer socket of this process, and make no more: for a process about to die by a
    signal, which runs no close(). A socket left behind is only untidy (the next daemon finds no
    engine listening there and removes it), but the directory is the operator's to read."""
    global _offered
    with _offered_lock:
        paths, _offered = _offered or set(), None
    for offer in paths:
        try:
            os.unlink(offer)
        except FileNotFoundError:
            pass


class ArenaOffer:
    """Watches a zero_copy lease; when the daemon goes, offers the arena until a daemon serves it again.

    The engine's lease (engine/loading/lease.py ``CacheLease``) owns the offer and closes it first.
    ``relink(sock)`` is the lease's ``replace_connection``, called from the offer's thread with the
    new lease connection once a restarted daemon serves the same arena id: it swaps the connection
    under the lease's lock, so the engine's own requests on it (``get_memory``) never see half a swap.
    ``connect()`` checks the restarted daemon like any engine connection (the socket's owner and the
    listening process's uid) before it returns one.
    """

    def __init__(self, lease: socket.socket, state: dict, fd: int, key: dict, path: Path, connect, relink):
        self.state, self.fd, self.key, self.path = state, fd, key, path
        self.arena_id = (state.get("arena") or {}).get("id")
        self._connect, self._relink = connect, relink
        self._lease = lease
        self._stop = threading.Event()
        self._fd_lock = threading.Lock()
        self.offer_path: Path | None = None
        self._listener: socket.socket | None = None
        self._watcher = Background(self._run)  # started without waiting for it (background.py)

    # The watcher polls for the daemon's hang-up without reading: the lease socket stays free for
    # the loader's own requests (get_memory).
    def _lease_lost(self) -> bool:
        poller = select.poll()
        poller.register(self._lease, select.POLLRDHUP)
        while not self._stop.is_set():
            for _fd, events in poller.poll(200):
                if events & select.POLLNVAL:  # our own side closed it: the engine is stopping
                    return False
                return True  # POLLRDHUP, POLLHUP or POLLERR: the daemon's side is gone
        return False

    def _run(self) -> None:
        try:
            while self._lease_lost():
                if not self._offer():
                    return
                if not self._serve_until_leased():
                    return
        except Exception:  # noqa: BLE001 - the engine keeps serving whatever happens here
            log.exception("Offering the weight arena back failed")
            self._withdraw()  # no socket left that nobody answers
        finally:
            if self._stop.is_set():  # close() gave up waiting for us: the descriptor is ours to close
                self._close_fd()

    def _offer(self) -> bool:
        offer = self.path.with_name(f"{OFFER_PREFIX}{secrets.token_hex(8)}.sock")
        listener = None
        try:
            if len(os.fsencode(offer)) > MAX_SOCKET_PATH:
                raise OSError(errno.ENAMETOOLONG, f"{offer} is longer than a Unix socket path may be")
            with _offered_lock:  # bound and registered at once: withdraw_offers() sees it or none is made
                if _offered is None:
                    return False  # the process is dying (withdraw_offers ran)
                listener = bind_private_socket(offer)
                _offered.add(offer)
            listener.listen(8)
            listener.settimeout(RELEASE_POLL_S)
        except OSError as e:
            log.warning(NO_OFFER.format(path=self.path, error=e))
            if listener is not None:  # ours, bound: never unlink a path we did not bind
                listener.close()
                self._forget(offer)
            return False
        self._listener, self.offer_path = listener, offer
        log.warning(LEASE_LOST.format(path=self.path, offer=offer))
        return True

    def _serve_until_leased(self) -> bool:
        """Answer adopters and try to re-lease; True once leased again (watch that lease next)."""
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                conn = None
            if conn is not None:
                with conn:
                    self._answer(conn)
            leased = self._try_lease()
            if leased is not None:
                self._withdraw()
                return leased
        return False

    def _answer(self, conn: socket.socket) -> None:
        try:
            pid, uid, _ = peer_cred(conn)
            conn.settimeout(ASK_TIMEOUT_S)
            req, fds = recv_frame(conn, timeout=ASK_TIMEOUT_S)  # the whole frame: a slow asker cannot stall the offer
            close_fds(fds)
            if uid != os.getuid():
                send_frame(conn, reply(False, error="rejected", message=f"uid {uid} may not take this arena"))
            elif req.get("op") != "hand_back":
                send_frame(conn, reply(False, error="protocol", message="expected hand_back"))
            elif req.get("socket") != self.path.name:  # a daemon of another device or model group
                send_frame(conn, reply(False, error=NOT_THIS_SOCKET, message=f"this offer is for {self.path.name}"))
            else:
                send_frame(conn, reply(True, key=self.key, socket=self.path.name, **{k: self.state.get(k) for k in
                                       ("arena", "manifest", "aliases", "attrs", "device_id")}), [self.fd])
                log.info(HANDED_BACK.format(pid=pid))
        except (OSError, ProtocolError, EOFError) as e:
            log.warning("A hand-back request failed: %s", e)

    def _try_lease(self) -> bool | None:
        """True: leased the same arena again. False: the daemon serves another copy. None: not yet."""
        try:
            sock, answer, fds = self._connect()
        except CacheUnusable as e:
            if e.kind in ("mismatch", "released"):  # a daemon serves this socket, with other weights
                log.warning(OTHER_COPY.format(path=self.path, why=e))
                return False
            return None  # no daemon yet, or one still starting: try again
        close_fds(fds)
        if self._stop.is_set():  # the engine is stopping: hold no new lease
            sock.close()
            return False
        if (answer.get("arena") or {}).get("id") == self.arena_id:
            self._lease = sock
            self._relink(sock)
            log.info(LEASED_AGAIN.format(path=self.path))
            return True
        sock.close()
        log.warning(OTHER_COPY.format(path=self.path, why=OWN_COPY))
        return False

    def _withdraw(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.offer_path is not None:
            self._forget(self.offer_path)
            self.offer_path = None

    @staticmethod
    def _forget(offer: Path) -> None:
        with _offered_lock:
            if _offered is not None:
                _offered.discard(offer)
        try:
            os.unlink(offer)
        except FileNotFoundError:
            pass

    def _close_fd(self) -> None:
        with self._fd_lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def close(self) -> None:
        self._stop.set()
        self._watcher.join(5)
        self._withdraw()
        if not self._watcher.is_alive():  # else the watcher closes it when it ends (it may be sending it)
            self._close_fd()


# -- daemon side ------------------------------------------------------------------------------
def offers(socket_path: Path) -> list[Path]:
    """The hand-back sockets engines left in this daemon's socket directory (oldest first, at most
    MAX_OFFERS): offers of every device; each says which daemon socket it is for when asked."""
    try:
        found = [p for p in socket_path.parent.iterdir() if p.name.startswith(OFFER_PREFIX)]
    except OSError:
        return []

    def age(p: Path) -> float:
        try:
            return os.lstat(p).st_mtime
        except OSError:
            return 0.0

    return sorted(found, key=age)[:MAX_OFFERS]


def take_back(socket_path: Path, key: dict, device_id: str, kind: str, device, rank: int, record=None,
              wait_s: float = 0.0):
    """(arena, aliases, attrs) from the first engine that hands back the arena ``record`` describes, else None.

    ``record`` (daemon/arena_record.py ``Record``) is this daemon's own account of the arena it
    packed for its current key, device, rank and transport. From an offer only the descriptor is
    taken: the arena's id, size, layout, aliases and attributes come from the record, and
    ``record.verify`` checks the bytes (raises ValueError). What the offer says about itself (its
    key, device, kind) only lets the daemon name why an engine's arena is not for it. Without a
    usable record nothing is adopted and no offer is asked.

    ``wait_s``: how long to keep polling the directory for offers not asked yet, until one answers
    for this daemon's socket (a standby that took the lock the instant the old daemon died is
    there before the engines have noticed; see rank.OFFER_AFTER_TAKEOVER_S).
    """
    if record is None or not record.usable:
        return None
    t0 = time.perf_counter()
    until = time.monotonic() + wait_s
    asked: set[Path] = set()
    while True:
        fresh = [o for o in offers(socket_path) if o not in asked]
        asked.update(fresh)
        adopted, answered = _take_back_from(fresh, socket_path, key, device_id, kind, device, rank, record, t0)
        if adopted is not None or answered or time.monotonic() >= until:
            break
        time.sleep(OFFER_POLL_S)
    if adopted is None and wait_s and not answered:
        log.info(NO_OFFER_AFTER_TAKEOVER.format(rank=rank, seconds=wait_s))
    return adopted


def _take_back_from(found: list[Path], socket_path: Path, key: dict, device_id: str, kind: str, device, rank: int,
                    record, t0: float):
    """(adopted or None, whether any offer answered with an arena for this socket) from ``found``."""
    candidates = []
    for offer in found:
        try:
            check_socket_file(offer)
        except OSError as e:
            log.warning(OFFER_SKIPPED.format(rank=rank, offer=offer, why=e))
            continue
        candidates.append(offer)
    if not candidates:
        return None, False
    deadline = time.monotonic() + ASK_BUDGET_S
    with ThreadPoolExecutor(max_workers=min(16, len(candidates)), thread_name_prefix="wcache-ask") as pool:
        answers = list(zip(candidates, pool.map(lambda o: _ask(o, rank, socket_path.name, deadline), candidates)))
    adopted, answered = None, False
    manifest, aliases, attrs = record.served
    for offer, got in answers:
        if got is None:
            continue
        answered = True
        pid, answer, fds = got
        if adopted is not None:
            close_fds(fds)
            continue
        t_import = time.perf_counter()
        try:
            _screen(answer, fds, key, device_id, kind)
            layout = Layout.from_manifest(manifest, record.descriptor()["size"])
            arena = adopt_arena(kind, record.descriptor(), layout, fds[0], device)
        except (ProtocolError, OSError, RuntimeError, ValueError) as e:
            close_fds(fds)
            log.warning(OFFER_SKIPPED.format(rank=rank, offer=offer, why=e))
            continue
        t_verify = time.perf_counter()
        try:
            record.verify(arena)
        except (ValueError, OSError, RuntimeError) as e:
            arena.close()
            log.warning(OFFER_SKIPPED.format(rank=rank, offer=offer, why=e))
            continue
        TIMINGS.update(import_arena=t_verify - t_import, verify=time.perf_counter() - t_verify)
        n = sum(len(g["names"]) for g in arena.layout.groups)
        log.info(ADOPTED.format(rank=rank, pid=pid, n=n, mib=arena.weights_bytes / 2**20,
                                seconds=time.perf_counter() - t0))
        adopted = arena, aliases, attrs
    return adopted, answered


def _ask(offer: Path, rank: int, socket_name: str, deadline: float):
    left = deadline - time.monotonic()
    if left <= 0:
        log.warning(OFFER_SKIPPED.format(rank=rank, offer=offer, why=f"no time left of the {ASK_BUDGET_S}s for offers"))
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(min(ASK_TIMEOUT_S, left))
    try:
        try:
            sock.connect(str(offer))
        except (ConnectionRefusedError, FileNotFoundError):
            # Nobody listens: the engine that made it is gone. It is a socket of our uid (checked).
            try:
                if stat.S_ISSOCK(os.lstat(offer).st_mode):
                    os.unlink(offer)
                    log.info(STALE_OFFER.format(offer=offer))
            except OSError:
                pass
            return None
        pid, uid, _ = peer_cred(sock)
        if uid != os.getuid():
            raise OSError(f"the process listening there runs as uid {uid}, not {os.getuid()}")
        send_frame(sock, request("hand_back", socket=socket_name))
        answer, fds = recv_frame(sock, timeout=max(0.01, deadline - time.monotonic()))
        if not answer.get("ok"):
            close_fds(fds)
            if answer.get("error") == NOT_THIS_SOCKET:  # another daemon's engine: not ours to judge
                return None
            raise ProtocolError(f"{answer.get('error')}: {answer.get('message')}")
        if answer.get("socket") != socket_name:
            close_fds(fds)
            raise ProtocolError(f"it offers the arena of {str(answer.get('socket'))[:128]!r}, not of {socket_name}")
        return pid, answer, fds
    except (OSError, ProtocolError, EOFError) as e:
        log.warning(OFFER_SKIPPED.format(rank=rank, offer=offer, why=e or type(e).__name__))
        return None
    finally:
        sock.close()


def _screen(answer: dict, fds: list[int], key: dict, device_id: str, kind: str) -> None:
    """Refuse an offer that says it is not for this daemon, naming why (an engine of other weights,
    device or transport). Passing proves nothing: the record and the bytes decide."""
    if len(fds) != 1:
        raise ProtocolError(f"expected one arena descriptor, got {len(fds)}")
    theirs = answer.get("key")
    if isinstance(theirs, dict) and (fields := mismatched_fields(key, theirs)):
        raise ValueError(f"it holds other weights (cache key fields differ: {fields[:8]})")
    if answer.get("device_id") not in (None, device_id):
        raise ValueError(f"it maps device {str(answer.get('device_id'))[:128]}, this rank serves {device_id}")
    desc = answer.get("arena")
    if isinstance(desc, dict) and desc.get("kind") not in (None, kind):
        raise ValueError(f"it holds a {str(desc.get('kind'))[:32]!r} arena, this rank serves {kind!r}")
