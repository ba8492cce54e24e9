"""A weight seed that lies, stalls, over-sends or closes midway: the replica names the fault and keeps
nothing it received. The source is a real TCP server in this process that answers with a genuine
header and arena (made by the real WeightSource from a real packed arena), then misbehaves one way
per test; the replica is the real weight_pull.pull, and at the end a real replica daemon, which
must exit 2 without ever binding its socket."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from procs import READY
from wcache.bench.seeding import small_files
from wcache.core.config import EngineConfig
from wcache.core.disk import load_processed
from wcache.core.fingerprint import cache_key, checkpoint_digest
from wcache.core.postprocess import ProcessedWeights
from wcache.daemon import weight_pull
from wcache.daemon.seed import SeedServer
from wcache.daemon.weight_source import WeightSource
from wcache.errors import SEED_WEIGHTS_FATAL
from wcache.wire.arena import manifest
from wcache.wire.protocol import recv_frame, send_frame
from wcache.wire.transports.memfd import MemfdArena

TOKEN = "fault-weights-token-0123456789"


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("root")
    mp = pytest.MonkeyPatch()
    mp.setenv("WCACHE_CACHE_ROOT", str(root))
    cfg = EngineConfig.build(str(tiny_model), device="cpu")
    files: dict = {}
    digest, _ = checkpoint_digest(tiny_model, entries=files)
    weights = load_processed(cfg, show_progress=False)
    arena = MemfdArena.pack(weights)
    shards = {n: e for n, e in files.items() if n != "config.json"}
    served = {"manifest": manifest(arena.layout), "aliases": weights.aliases, "attrs": weights.attrs,
              "weights_bytes": weights.nbytes}
    source = WeightSource(0, cache_key(cfg, digest), str(tiny_model), shards, served, lambda: arena, 0.0)
    bare = small_files(Path(tiny_model), tmp_path_factory.mktemp("d") / "bare")
    yield {"source": source, "arena": arena, "header": source.header(arena),
           "bytes": bytes(arena.mapping[:arena.size]), "bare": bare, "cfg": EngineConfig.build(str(bare), device="cpu")}
    mp.undo()


class FakeSource:
    """Answers one get_weights request with ``header`` and then does ``act(conn)``."""

    def __init__(self, header: dict, act):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.header, self.act = header, act
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        conn, _ = self.sock.accept()
        with conn:
            recv_frame(conn)
            send_frame(conn, {**self.header, "transfer": "stream"})
            self.act(conn)
            time.sleep(0.2)

    def close(self):
        self.sock.close()


def pull(world, header, act, stall_s: float = 30.0):
    fake = FakeSource(header, act)
    fds = len(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(weight_pull.SeedWeightsError) as e:
            weight_pull.pull(fake.address, TOKEN, world["cfg"], "memfd", False, stall_s)
    finally:
        fake.close()
    assert len(os.listdir("/proc/self/fd")) <= fds  # the half-received memfd is gone, not kept
    return e.value


def test_genuine_bytes_are_taken_and_equal_the_sources(world):
    fake = FakeSource(world["header"], lambda c: (c.sendall(world["bytes"]), c.shutdown(socket.SHUT_WR)))
    seeded = weight_pull.pull(fake.address, TOKEN, world["cfg"], "memfd", False)
    fake.close()
    assert bytes(seeded.arena.mapping[:seeded.arena.size]) == world["bytes"]
    assert seeded.key == world["header"]["key"]
    seeded.arena.close()


def test_a_lying_source_fails_the_digests(world):
    lie = bytearray(world["bytes"])
    lie[len(lie) // 3] ^= 0x01  # one bit of one weight
    err = pull(world, world["header"], lambda c: (c.sendall(lie), c.shutdown(socket.SHUT_WR)))
    assert err.kind == "digest" and "chunks [0] of 1" in str(err)


def test_a_source_that_stalls_midway_is_named(world):
    half = len(world["bytes"]) // 2
    err = pull(world, world["header"], lambda c: (c.sendall(world["bytes"][:half]), time.sleep(2.5)), stall_s=1.0)
    assert err.kind == "stalled" and f"({half} of {len(world['bytes'])} bytes received)" in str(err)


def test_a_source_that_sends_more_than_the_layout_needs_is_refused(world):
    err = pull(world, world["header"], lambda c: c.sendall(world["bytes"] + b"\0"))
    assert err.kind == "oversent"


def test_a_source_that_closes_early_is_named(world):
    err = pull(world, world["header"], lambda c: c.sendall(world["bytes"][:1000]))
    assert err.kind == "closed" and f"after 1000 of {len(world['bytes'])} bytes" in str(err)


def test_a_source_that_announces_more_bytes_than_its_layout_is_refused_before_receiving(world):
    size = world["header"]["size"] + (4 << 20)
    header = {**world["header"], "size": size}
    err = pull(world, header, lambda c: c.sendall(b"\0" * 4096))
    assert err.kind == "oversize" and f"offers {size} bytes" in str(err)


def test_a_source_that_lies_about_its_key_is_refused_naming_the_fields(world):
    header = {**world["header"], "key": {**world["header"]["key"], "dtype": "float32", "tp_size": 2}}
    err = pull(world, header, lambda c: None)
    assert err.kind == "mismatch" and "['dtype', 'tp_size']" in str(err)
    shards = {n: [s, "0" * 64] for n, (s, _h) in world["header"]["shards"].items()}
    err = pull(world, {**world["header"], "shards": shards}, lambda c: None)
    assert err.kind == "mismatch" and "['checkpoint']" in str(err)


def test_the_real_source_refuses_a_bad_token_and_another_key_naming_the_fields(world, tmp_path):
    server = SeedServer("127.0.0.1", 0, TOKEN, lambda: None, 0, weights=world["source"]).start()
    address = f"127.0.0.1:{server.sock.getsockname()[1]}"
    try:
        with pytest.raises(weight_pull.SeedWeightsError) as e:
            weight_pull.pull(address, "not-the-token-0123456789", world["cfg"], "memfd", False)
        assert e.value.kind == "token"
        other = EngineConfig.build(str(world["bare"]), dtype="float32", device="cpu")
        with pytest.raises(weight_pull.SeedWeightsError) as e:
            weight_pull.pull(address, TOKEN, other, "memfd", False)
        assert e.value.kind == "mismatch" and "['dtype']" in str(e.value)
        seeded = weight_pull.pull(address, TOKEN, world["cfg"], "memfd", False)
        assert bytes(seeded.arena.mapping[:seeded.arena.size]) == world["bytes"]
        seeded.arena.close()
    finally:
        server.close()


def test_a_replica_daemon_without_shards_exits_2_on_a_lying_source_and_never_serves(world, procs):
    lie = bytearray(world["bytes"])
    lie[-len(lie) // 4] ^= 0x80
    fake = FakeSource(world["header"], lambda c: (c.sendall(lie), c.shutdown(socket.SHUT_WR)))
    p = procs.preload(world["bare"], "--weight-cache-seed", fake.address, "--weight-cache-seed-token", TOKEN,
                      "--no-enable-autotune", ready=False)
    assert p.exit_code(timeout=120) == 2
    fake.close()
    log = p.log()
    assert SEED_WEIGHTS_FATAL.split("{reason}")[1] in log and "do not match the seed's digests" in log
    assert READY not in log and "serving on" not in log


def test_a_replica_that_asks_mid_round_is_queued_and_served_by_the_next_round(world, caplog):
    """Round 1 streams 32 MiB to a client that reads nothing yet (more than the socket buffers hold),
    so it is in flight when a real replica asks: that one is told it is queued, and gets the weights
    from round 2 once round 1 is done."""
    big = MemfdArena.pack(ProcessedWeights({"w": torch.randint(0, 256, (32 << 20,), dtype=torch.uint8)}))
    served = {"manifest": manifest(big.layout), "aliases": {}, "attrs": {}, "weights_bytes": 32 << 20}
    source = WeightSource(0, world["source"].key, str(world["bare"]), world["source"].shards, served,
                          lambda: big, 0.0)
    server = SeedServer("127.0.0.1", 0, TOKEN, lambda: None, 0, weights=source).start()
    address = ("127.0.0.1", server.sock.getsockname()[1])
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        slow.connect(address)
        key = {**world["source"].key, "checkpoint": None}
        send_frame(slow, {"v": 1, "op": "get_weights", "token": TOKEN, "key": key, "small": source.small})
        header, _ = recv_frame(slow, max_bytes=64 << 20, timeout=30)
        time.sleep(0.5)
        assert header["transfer"] == "stream" and source.sending
        result = {}
        late = threading.Thread(target=lambda: result.update(seeded=weight_pull.pull(
            f"127.0.0.1:{address[1]}", TOKEN, world["cfg"], "memfd", False)))
        with caplog.at_level("INFO", logger="wcache.seed"):
            late.start()
            time.sleep(1.0)
            assert "seeded" not in result  # still waiting for its round
            got = 0
            while chunk := slow.recv(1 << 20):  # now round 1 drains, and round 2 starts
                got += len(chunk)
            late.join(60)
        assert got == big.size and source.rounds == 2
        assert "is serving another round; queued for the next" in caplog.text
        assert bytes(result["seeded"].arena.mapping[:big.size]) == bytes(big.mapping[:big.size])
        result["seeded"].arena.close()
    finally:
        slow.close()
        server.close()
        big.close()
