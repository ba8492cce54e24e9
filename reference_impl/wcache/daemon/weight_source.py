"""The source side of weight seeding: a running daemon hands its rank's arena to replicas.

Served on the autotune seed port (seed.py) as the ``get_weights`` op, after the token check there.
Then, here, before a byte of the arena leaves:

* the cache key: every field of the replica's key must equal the source's (a replica without shards
  sends no checkpoint digest; then its config.json and the shard names its index lists must match
  the source's instead); a refusal names the differing fields;
* the reply header: the source's key, each shard's [size, sha256] (for the replica's own key), the
  manifest, aliases, attrs, the arena's size, and a digest per chunk computed from the arena
  (weight_digest.py; computed once, on the first request).

Rounds: requests that arrive within ``window_s`` of the first one waiting form one round; with
``expect`` (``--weight-cache-seed-round-replicas``) the round starts as soon as that many wait, so a
scale-up of a known size pays no window at all (the window still bounds the wait for one that never
comes). A round of
one streams the arena over its own connection, exactly ``size`` bytes, then closes its sending side.
A round of several is a gloo fan-out (seed_round.py) in which the source sends the arena once. A
request that arrives while a round is in flight is told it is queued and joins the next round,
which starts as soon as this one ends (its window counted from its own arrival). The replica's
verdict (digests checked or not) comes back on its connection and is logged.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid

import torch

from wcache.core.fingerprint import mismatched_fields
from wcache.core.seeded_checkpoint import small_identity
from wcache.daemon import seed_round, weight_digest
from wcache.daemon.seed_settings import MAX_ROUND
from wcache.errors import SEED_ROUND_DONE
from wcache.wire.protocol import ProtocolError, recv_frame, reply, send_frame

log = logging.getLogger("wcache.seed")

STALL_S = 30.0  # a send that makes no progress for this long fails that replica
VERDICT_WAIT_S = 120.0  # for the replica to check the digests and answer
DEFAULT_WINDOW_S = 2.0


class _Ticket:
    def __init__(self, conn: socket.socket, peer: str):
        self.conn, self.peer, self.arrived = conn, peer, time.monotonic()
        self.done = threading.Event()
        self.sent = False


class WeightSource:
    def __init__(self, rank: int, key: dict, model: str, shards: dict, served: dict, get_arena,
                 window_s: float | None = None, expect: int | None = None):
        self.rank, self.key, self.shards, self.served = rank, key, shards, served
        self.small = small_identity(model)
        self.get_arena = get_arena  # None once released (copy mode)
        self.window_s = DEFAULT_WINDOW_S if window_s is None else window_s
        self.expect = min(expect or MAX_ROUND, MAX_ROUND)  # a full round starts at once in any case
        self.cond = threading.Condition()
        self.pending: list[_Ticket] = []
        self.leading = False  # a thread is forming or running rounds
        self.sending = False  # a round is in flight
        self.rounds = 0
        self._digests = None
        self._digest_lock = threading.Lock()

    # -- checks --------------------------------------------------------------------------------
    def refusal(self, req: dict) -> dict | None:
        key, small = req.get("key"), req.get("small")
        if not isinstance(key, dict) or not isinstance(small, dict):
            return reply(False, error="protocol", message="get_weights needs a key and a small-files object")
        mine, theirs = dict(self.key), dict(key)
        if theirs.get("checkpoint") is None:  # a replica without shards: compare its small files instead
            mine.pop("checkpoint", None)
            theirs.pop("checkpoint", None)
        fields = mismatched_fields(mine, theirs)
        fields += [f for f in ("config_sha256", "shards") if small.get(f) != self.small.get(f)]
        if fields:
            return reply(False, error="mismatch", fields=[str(f)[:128] for f in fields[:64]])
        if self.get_arena() is None:
            return reply(False, error="released", message="this daemon has released its weights")
        return None

    def header(self, arena) -> dict:
        with self._digest_lock:
            if self._digests is None:
                t0 = time.perf_counter()
                algorithm = weight_digest.algorithm_for(arena.tensor().device.type)
                secret = weight_digest.new_secret(algorithm)
                self._digests = {"algorithm": algorithm, "secret": secret, "chunk_bytes": weight_digest.CHUNK_BYTES,
                                 "chunks": weight_digest.digests(arena.tensor(), algorithm, secret)}
                log.info("Rank %d hashed its arena for seeding (%d chunks) in %.2f s", self.rank,
                         len(self._digests["chunks"]), time.perf_counter() - t0)
        return reply(True, key=self.key, shards=self.shards, size=arena.size, digests=self._digests, **self.served)

    # -- one replica's connection ----------------------------------------------------------------
    def serve(self, conn: socket.socket, req: dict, peer: str) -> None:
        refused = self.refusal(req)
        if refused is not None:
            send_frame(conn, refused)
            return
        ticket = _Ticket(conn, peer)
        with self.cond:
            self.pending.append(ticket)
            lead, queued = not self.leading, self.sending
            self.leading = True
            self.cond.notify_all()  # the leader waiting out a window counts the arrivals
        if queued:
            send_frame(conn, reply(True, queued=True))
        if lead:
            self._lead()
        ticket.done.wait()
        if ticket.sent:
            self._verdict(ticket)

    def _verdict(self, t: _Ticket) -> None:
        try:
            answer, _ = recv_frame(t.conn, max_bytes=4096, timeout=VERDICT_WAIT_S)
        except (OSError, EOFError, ProtocolError, TimeoutError) as e:
            log.warning("Replica at %s gave no verdict on the seeded weights: %s", t.peer, e or type(e).__name__)
            return
        if answer.get("verified") is True:
            log.info("Replica at %s checked the seeded weights of rank %d", t.peer, self.rank)
        else:
            log.warning("Replica at %s refused the seeded weights of rank %d: %s", t.peer, self.rank,
                        str(answer.get("reason"))[:300])

    # -- rounds ------------------------------------------------------------------------------------
    def _lead(self) -> None:
        """Form and run rounds until nobody waits (on the thread of the request that found none running)."""
        try:
            while True:
                with self.cond:
                    deadline = self.pending[0].arrived + self.window_s
                    while len(self.pending) < self.expect and time.monotonic() < deadline:
                        self.cond.wait(deadline - time.monotonic())
                    batch, self.pending = self.pending[:MAX_ROUND], self.pending[MAX_ROUND:]
                    self.sending = True
                try:
                    self._round(batch)
                finally:
                    for t in batch:
                        t.done.set()
                    with self.cond:
                        self.sending = False
                        idle = not self.pending
                        if idle:
                            self.leading = False
                if idle:
                    return
        except BaseException:
            with self.cond:
                for t in self.pending:
                    t.done.set()
                self.pending, self.leading, self.sending = [], False, False
            raise

    def _round(self, batch: list[_Ticket]) -> None:
        self.rounds += 1
        arena = self.get_arena()
        if arena is None:
            for t in batch:
                _quietly(send_frame, t.conn, reply(False, error="released", message="released its weights"))
            return
        header = self.header(arena)
        sent0, t0 = seed_round.bytes_written(), time.perf_counter()
        self.streamed = 0  # send(2) is not counted in wchar (write(2), gloo's, is): counted here
        try:
            if len(batch) == 1:
                how = "one TCP stream"
                self._stream(batch[0], header, arena.tensor())
            else:
                how = f"a gloo scatter + ring all-gather of {len(batch) + 1} ranks"
                self._fan_out(batch, header, arena.tensor())
        except (OSError, RuntimeError) as e:  # a replica that went away or stalled: the next round is unaffected
            log.warning("Seeding round %d of rank %d failed: %s", self.rounds, self.rank, str(e)[:300])
            return
        log.info(SEED_ROUND_DONE.format(round=self.rounds, replicas=len(batch), rank=self.rank, how=how,
                                        seconds=time.perf_counter() - t0,
                                        sent=seed_round.bytes_written() - sent0 + self.streamed,
                                        size=arena.size))

    def _stream(self, t: _Ticket, header: dict, data: torch.Tensor) -> None:
        t.conn.settimeout(STALL_S)
        send_frame(t.conn, {**header, "transfer": "stream"})
        t.sent = True
        for a, b in weight_digest.chunk_bounds(data.numel()):
            part = data[a:b]
            t.conn.sendall(memoryview((part.cpu() if part.is_cuda else part).numpy()))
            self.streamed += b - a
        t.conn.shutdown(socket.SHUT_WR)  # exactly the arena's bytes: the replica reads end-of-stream next

    def _fan_out(self, batch: list[_Ticket], header: dict, data: torch.Tensor) -> None:
        host = batch[0].conn.getsockname()[0]  # the address these replicas reached us on
        store = seed_round.open_store(host)
        prefix = f"wcache-seed/{self.rank}/{self.rounds}/{uuid.uuid4().hex[:8]}"
        world = len(batch) + 1
        for i, t in enumerate(batch, start=1):
            t.conn.settimeout(STALL_S)
            send_frame(t.conn, {**header, "transfer": "round",
                                "round": {"store": [host, store.port], "prefix": prefix, "rank": i, "world": world,
                                          "chunk_bytes": seed_round.ROUND_CHUNK_BYTES}})
            t.sent = True
        seed_round.send(store, prefix, world, host, data, seed_round.ROUND_CHUNK_BYTES)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:
        pass
