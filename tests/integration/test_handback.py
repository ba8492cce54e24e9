"""A restarted daemon takes the arena back from a running zero_copy engine instead of reloading.

Real daemons and engines throughout; the hostile offers are a real Unix socket served by this
test, handing real descriptors (an unsealed memfd, a manifest that reaches outside its arena).
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import threading
from pathlib import Path

import pytest
from itest import call, default_socket, memfd_inode, rank_pids, wait_until
from procs import complete, engine_pid
from wcache.core.checkpoint import make_checkpoint
from wcache.core.config import EngineConfig
from wcache.core.device import device_identity
from wcache.core.disk import load_processed
from wcache.errors import (
    ARENA_NOT_RECORDED,
    ADOPTED,
    RECORD_NOT_USABLE,
    HANDED_BACK,
    LEASE_LOST,
    LEASED_AGAIN,
    NO_OFFER,
    OFFER_SKIPPED,
    OTHER_COPY,
    OWN_COPY,
    STALE_OFFER,
)
from wcache.core.fingerprint import cache_key
from wcache.wire.handback import OFFER_PREFIX
from wcache.wire.protocol import recv_frame, reply, send_frame
from wcache.wire.arena import manifest
from wcache.wire.transports.memfd import MemfdArena

NO_TUNE = "--no-enable-autotune"
LOADED = "Rank 0 loaded 27 tensors"
ZERO_COPY = ("--load-format", "ipc_cache", NO_TUNE)


def offers_next_to(sock: Path) -> list[Path]:
    """The hand-back offers in the socket's directory (their names never depend on the device)."""
    return sorted(sock.parent.glob(OFFER_PREFIX + "*"))


def kill_daemon(pre) -> int:
    """SIGKILL the rank (as a crash would), then stop its launcher; the rank's pid."""
    [rank] = rank_pids(pre.pid)
    os.kill(rank, signal.SIGKILL)
    pre.wait_for_log("exited: {0: -9}", timeout=30)
    pre.stop()
    return rank


def orphaned_engine(procs, model, env, prompt: str):
    """A zero_copy engine whose daemon was killed: (engine, socket, its answer, its offer, the arena's inode)."""
    first = procs.preload(model, NO_TUNE)
    sock = default_socket(env)
    inode = memfd_inode(rank_pids(first.pid)[0])
    engine = procs.serve(model, *ZERO_COPY)
    answer = complete(engine.port, prompt)
    kill_daemon(first)
    engine.wait_for_log("went away; this engine keeps serving", timeout=15)
    [offer] = offers_next_to(sock)
    assert LEASE_LOST.format(path=sock, offer=offer) in engine.log()
    return engine, sock, answer, offer, inode


def test_a_restarted_daemon_adopts_the_arena_of_a_running_engine(procs, tiny_model, wcache_env):
    engine, sock, answer, offer, inode = orphaned_engine(procs, tiny_model, wcache_env, "restart me")
    assert complete(engine.port, "restart me")["choices"] == answer["choices"]  # serves while the daemon is gone

    second = procs.preload(tiny_model, NO_TUNE)
    log = second.log()
    assert ADOPTED.split("{mib")[0].format(rank=0, pid=engine_pid(engine.pid), n=27) in log
    assert "without reading the checkpoint" in log and LOADED not in log
    [rank2] = rank_pids(second.pid)
    assert memfd_inode(rank2) == inode  # the first daemon's memory, not a new copy
    engine.wait_for_log(LEASED_AGAIN.format(path=sock), timeout=15)
    assert HANDED_BACK.format(pid=rank2) in engine.log()
    wait_until(lambda: not offers_next_to(sock), 10, "the engine to withdraw its offer")
    assert call(sock, "get_memory")["zero_copy_engines"] == 1  # the engine's lease, held again
    assert complete(engine.port, "restart me")["choices"] == answer["choices"]

    # A new engine maps the adopted arena and answers the same.
    other = procs.serve(tiny_model, *ZERO_COPY)
    assert "Mapped 27 tensors from the weight cache daemon (zero_copy mode)" in other.log()
    assert complete(other.port, "restart me")["choices"] == answer["choices"]
    assert other.stop() == 0

    # And the adopted daemon, killed in turn, is adopted again: the lease is watched anew.
    kill_daemon(second)
    engine.wait_for_log("went away; this engine keeps serving", timeout=15)
    third = procs.preload(tiny_model, NO_TUNE)
    assert memfd_inode(rank_pids(third.pid)[0]) == inode and LOADED not in third.log()
    assert engine.stop() == 0
    assert not offers_next_to(sock)


def test_other_weights_are_not_adopted_and_the_engine_keeps_its_own(procs, tiny_model, wcache_env, tmp_path):
    other_model = make_checkpoint(tmp_path / "other", "tiny", seed=7)
    engine, sock, answer, offer, _ = orphaned_engine(procs, tiny_model, wcache_env, "keep me")

    second = procs.preload(other_model, NO_TUNE)
    log = second.log()
    # Its record is of the arena packed for the first model: no offer can be adopted, none is asked.
    assert RECORD_NOT_USABLE.format(rank=0, why="its record is of an arena packed for other weights (cache key "
                                                "fields differ: ['checkpoint'])") in log, log
    assert LOADED in log and "adopted" not in log and HANDED_BACK.split(" (")[0] not in engine.log()
    engine.wait_for_log(OTHER_COPY.format(path=sock, why="WeightCacheKey mismatch on fields: ['").split("['")[0],
                        timeout=15)
    wait_until(lambda: not offers_next_to(sock), 10, "the engine to withdraw its offer")
    assert call(sock, "get_memory")["zero_copy_engines"] == 0
    assert complete(engine.port, "keep me")["choices"] == answer["choices"]  # still its own weights


def test_an_engine_that_stops_while_offering_removes_its_offer(procs, tiny_model, wcache_env):
    engine, sock, _, offer, _ = orphaned_engine(procs, tiny_model, wcache_env, "bye")
    # Anything but a hand_back request is refused, a malformed frame too, and the offer stays.
    assert call(offer, "get_state") == {"v": 1, "ok": False, "error": "protocol", "message": "expected hand_back"}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(offer))
        s.sendall(b"\x00\x00\x00\x00\x00\x00\x00\x05hello")
        assert s.recv(100) == b""  # closed without an answer
    engine.wait_for_log("A hand-back request failed: frame is not valid JSON", timeout=10)
    # An offer answers only for its own daemon socket; another device's daemon is told so.
    assert call(offer, "hand_back", socket="wcache_weight_cache_other.sock")["error"] == "not_this_socket"
    assert call(offer, "hand_back", socket=sock.name)["ok"] is True  # still offered (the descriptor is closed)
    assert offer.exists() and engine.stop() == 0
    assert not offers_next_to(sock)


def test_no_weight_cache_adopt_loads_from_disk(procs, tiny_model, wcache_env):
    engine, sock, _, _, _ = orphaned_engine(procs, tiny_model, wcache_env, "opt out")

    second = procs.preload(tiny_model, NO_TUNE, "--no-weight-cache-adopt")
    assert LOADED in second.log() and "adopt" not in second.log()
    engine.wait_for_log(OTHER_COPY.format(path=sock, why=OWN_COPY), timeout=15)
    assert engine.stop() == 0


class FakeOffers:
    """Hand-back sockets served by this test: each answers every request with its own reply."""

    def __init__(self):
        self.stop = threading.Event()
        self.threads = []

    def add(self, path: Path, answer: dict, fds: list[int]) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(4)
        listener.settimeout(0.2)

        def serve():
            with listener:
                while not self.stop.is_set():
                    try:
                        conn, _ = listener.accept()
                    except TimeoutError:
                        continue
                    with conn:
                        recv_frame(conn)
                        send_frame(conn, answer, fds)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        self.threads.append(t)


@pytest.fixture
def fake_offers():
    f = FakeOffers()
    yield f
    f.stop.set()
    for t in f.threads:
        t.join(5)


def test_hostile_offers_are_refused_with_their_reason_and_a_forged_arena_is_never_adopted(procs, tiny_model,
                                                                                         wcache_env,
                                                                             fake_offers, tmp_path):
    cfg = EngineConfig.build(str(tiny_model), "auto", None, "cpu")
    sock = default_socket(wcache_env)
    procs.preload(tiny_model, NO_TUNE).stop()  # a daemon that packed and recorded its arena, then stopped
    good = MemfdArena.pack(load_processed(cfg, False))
    state = {"key": cache_key(cfg), "socket": sock.name, "arena": good.descriptor(), "manifest": manifest(good.layout),
             "aliases": {},
             "attrs": {}, "device_id": device_identity("cpu", 0)}

    unsealed = os.memfd_create("fake", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, good.size)
    outside = {"groups": [dict(good.layout.groups[0], offset=good.size)]}
    cases = [  # (name, answer, fds, the reason the daemon logs)
        ("nofd", reply(True, **state), [], "expected one arena descriptor, got 0"),
        ("device", reply(True, **(state | {"device_id": "cuda-GPU-0-0"})), [good.fd],
         "it maps device cuda-GPU-0-0, this rank serves cpu-"),
        ("unsealed", reply(True, **state), [unsealed], "the handed-back memfd is not sealed against writes"),
        # The offer's manifest is never read (the record's is served): this one is refused for its bytes.
        ("outside", reply(True, **(state | {"manifest": outside})), [good.fd], ARENA_NOT_RECORDED),
        ("refuses", reply(False, error="rejected", message="no"), [], "rejected: no"),
        # Sealed, the right key, device and manifest: everything an engine can make. But this daemon's
        # cache never packed it (no record), so it is a forgery, and it is refused.
        ("forged", reply(True, **state), [good.fd], ARENA_NOT_RECORDED),
    ]
    paths = {}
    for i, (name, answer, fds, _) in enumerate(cases):
        paths[name] = sock.with_name(f"{OFFER_PREFIX}{i:02d}{name}.sock")
        fake_offers.add(paths[name], answer, fds)
        os.utime(paths[name], (1_000_000 + i, 1_000_000 + i), follow_symlinks=False)  # tried in this order
    stale = sock.with_name(f"{OFFER_PREFIX}00stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))  # bound, never listened: what a SIGKILLed engine leaves
    os.utime(stale, (999_999, 999_999), follow_symlinks=False)

    daemon = procs.preload(tiny_model, NO_TUNE)
    log = daemon.log()
    assert STALE_OFFER.format(offer=stale) in log and not stale.exists()
    for name, _, _, why in cases:
        if why:
            assert OFFER_SKIPPED.format(rank=0, offer=paths[name], why=why) in log, name
    assert "adopted the arena" not in log and LOADED in log  # from disk: nothing offered was ours
    [rank] = rank_pids(daemon.pid)
    assert memfd_inode(rank) != os.fstat(good.fd).st_ino
    engine = procs.serve(tiny_model, *ZERO_COPY)
    reference = procs.serve(tiny_model, NO_TUNE)  # from disk
    assert complete(engine.port, "trust")["choices"] == complete(reference.port, "trust")["choices"]
    os.close(unsealed)
    good.close()


def test_the_offer_fits_wherever_the_daemon_socket_fits(procs, tiny_model, wcache_env):
    # A daemon socket of exactly 107 bytes, the Unix limit: the offer's name never depends on the
    # device (a GPU UUID once made it `<socket>.handback-...`, past the limit), so it still fits.
    base = Path(wcache_env["TMPDIR"])
    name_len = len("wcache_weight_cache_cpu-3dc72624-0.sock") + 1
    sockets = base / ("d" * (107 - len(str(base)) - 1 - name_len))
    sockets.mkdir(mode=0o700)
    first = procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(sockets))
    [sock] = [p for p in sockets.iterdir() if p.name.endswith(".sock")]
    assert len(os.fsencode(sock)) == 107, sock
    engine = procs.serve(tiny_model, *ZERO_COPY, "--model-loader-extra-config", f'{{"socket_dir": "{sockets}"}}')
    answer = complete(engine.port, "room")
    kill_daemon(first)
    engine.wait_for_log("went away; this engine keeps serving", timeout=15)
    [offer] = offers_next_to(sock)
    assert len(os.fsencode(offer)) < len(os.fsencode(sock))
    assert "cannot offer them" not in engine.log()
    again = procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(sockets))
    assert "Rank 0 adopted the arena of a running engine" in again.log()
    assert complete(engine.port, "room")["choices"] == answer["choices"]


def test_an_engine_that_cannot_create_its_offer_says_so_and_keeps_serving(procs, tiny_model, wcache_env):
    """NO_OFFER, produced for real: the socket directory is gone when the daemon dies (renamed away
    here; a cleaned-up tmpfs or a recreated volume does the same), so binding the offer next to the
    daemon's socket fails. The engine says why, offers nothing, and keeps serving its weights."""
    base = Path(wcache_env["TMPDIR"])  # short: pytest's tmp paths are too long for a socket path
    sockets = base / "sockets"
    sockets.mkdir(mode=0o700)
    first = procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(sockets))
    [sock] = [p for p in sockets.iterdir() if p.name.endswith(".sock")]
    engine = procs.serve(tiny_model, *ZERO_COPY, "--model-loader-extra-config", f'{{"socket_dir": "{sockets}"}}')
    answer = complete(engine.port, "no offer")
    aside = sockets.rename(base / "aside")
    try:
        kill_daemon(first)
        engine.wait_for_log(NO_OFFER.split("{error}")[0].format(path=sock), timeout=15)
        assert f"[Errno {errno.ENOENT}]" in engine.log().split("cannot offer them: ")[1].splitlines()[0]
        assert "went away; this engine keeps serving" not in engine.log()  # no offer was made
        assert complete(engine.port, "no offer")["choices"] == answer["choices"]
        assert engine.stop() == 0
    finally:
        aside.rename(sockets)
    assert not offers_next_to(sock)
