"""One live daemon against load and hostile input: 64 engines at once, a full daemon, at least
10,000 malformed frames on its Unix socket and more on its seed listener, release under a zero_copy
lease that has been idle past the request timeout; then the daemon still hands a valid engine its
weights. Throughout: the rank never dies, never keeps a descriptor or a thread, and every bad frame
is answered with its reason before the connection closes.

The frames come from a seeded generator (faultlib; WCACHE_FUZZ_SEED replays a run). Each
connection sends a few requests that keep it open, then usually one bad frame: so the count of
malformed frames equals the number of connections, and the well-formed ones ride along.
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from faultlib import (
    HERE,
    SEED,
    TALLY,
    alive,
    call,
    check_replies,
    connection_plan,
    exchange,
    fd_count,
    frame,
    settle,
    split_replies,
    terminal,
    thread_count,
    wait_until,
)
from procs import free_port, http
from wcache.daemon import seed
from wcache.core.config import EngineConfig
from wcache.daemon.rank import MAX_CLIENTS, REQUEST_TIMEOUT_S
from wcache.engine.loading.registry import load_weights
from wcache.errors import DAEMON_ERRORS, FALLBACK, REASONS, SEED_BUSY
from wcache.engine.loading.config import LoaderConfig
from wcache.engine.loading.ipc_cache import IpcCacheLoader
from wcache.model.llama import bind_weights, build_meta_model
from wcache.wire.protocol import request

pytestmark = pytest.mark.slow

MALFORMED = 10_000  # bad frames on the daemon's socket (each on its own connection)
SEED_MALFORMED = 1_500  # bad frames on the seed listener before the bad-token phase
TOKEN = "fault-suite-seed-token-0123456789"
PROMPT = [256, *b"after the storm"]


@pytest.fixture(scope="module")
def ports():
    return {"health": free_port(), "seed": free_port()}


@pytest.fixture(scope="module")
def daemon(fault_procs, tiny_model, ports):
    return fault_procs.preload(tiny_model, "--no-enable-autotune",
                               "--weight-cache-health-port", str(ports["health"]),
                               "--weight-cache-health-host", "127.0.0.1",
                               "--weight-cache-seed-listen", f"127.0.0.1:{ports['seed']}",
                               "--weight-cache-seed-token", TOKEN)


@pytest.fixture(scope="module")
def cfg(tiny_model):
    return EngineConfig.build(str(tiny_model), "auto", None, "cpu")


@pytest.fixture(scope="module")
def lease(sock, cfg):
    """The suite's own zero_copy engine, mapped for the whole module: no release may succeed while
    it lives, whatever the fuzzer sends."""
    _, report, lease = IpcCacheLoader(LoaderConfig(socket_path=str(sock), fallback=False)).load(cfg)
    assert report.source == "the weight cache (zero_copy)"
    report.t0 = time.monotonic()
    yield report
    lease.close()


def healthy(ports) -> bool:
    return http("GET", f"http://127.0.0.1:{ports['health']}/health", timeout=5) == (200, {"status": "ready"})


def check_daemon(daemon, rank, ports) -> None:
    """Alive, healthy, and no traceback from any of its threads in its log."""
    if not alive(rank):
        TALLY.crashes += 1
    assert alive(rank), f"the daemon rank died:\n{daemon.log()[-4000:]}"
    assert healthy(ports)
    assert "Traceback" not in daemon.log(), daemon.log()[-4000:]


def test_64_engines_at_once_are_all_served(daemon, rank, sock, lease, tiny_model, fault_env, ports):
    TALLY.fault("64 engines connect at once")
    fds, threads = fd_count(rank), thread_count(rank)
    storm = subprocess.Popen([sys.executable, str(HERE / "storm_clients.py"), str(tiny_model), str(sock), "64", "4"],
                             env=fault_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        line = storm.stdout.readline()
        assert line, storm.communicate(timeout=30)
        result = json.loads(line)
        print(f"64 engines: served {result['served']} in {result['wall_s']:.2f} s "
              f"(slowest {result['slowest_s']:.2f} s): {result['sources']}")
        assert result["errors"] == {}
        assert result["served"] == 64
        assert result["sources"] == {"the weight cache (zero_copy)": 48, "the weight cache (copy)": 16}
        assert len(result["checksums"]) == 1 and result["tensors"] == [27]  # the same weights for all
        # 48 zero_copy engines hold leases, and so does the suite's own; the copy-mode engines' release
        # was refused (those leases), so nothing was released.
        memory = call(sock, "get_memory")
        assert memory["zero_copy_engines"] == 49 and memory["released"] is False
        assert "(in_use): release refused: " in daemon.log()
    finally:
        _, err = storm.communicate(timeout=60)  # closes stdin: the engines let go
    assert storm.returncode == 0, err
    wait_until(lambda: call(sock, "get_memory")["zero_copy_engines"] == 1, 10, "the 48 leases to end")
    leaked = settle(rank, fds)
    TALLY.leaked_fds += leaked
    assert leaked == 0 and settle(rank, threads, thread_count) == 0
    check_daemon(daemon, rank, ports)


def test_a_full_daemon_refuses_with_busy_and_a_waiting_engine_gets_in(daemon, rank, sock, lease, cfg, ports,
                                                                      caplog):
    TALLY.fault("more connections than the daemon serves")
    caplog.set_level(logging.INFO, "wcache.engine.loader")
    threads = thread_count(rank)
    idle = []
    try:
        for _ in range(MAX_CLIENTS - 1):  # with the suite's lease, every slot is taken
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            idle.append(s)
        wait_until(lambda: thread_count(rank) >= threads + MAX_CLIENTS - 1, 30, "the daemon to take every slot")
        busy = REASONS["busy"].format(path=sock, detail=DAEMON_ERRORS["busy"].format(max=MAX_CLIENTS))
        _, report, _lease = load_weights(cfg, "ipc_cache", LoaderConfig(socket_path=str(sock)))
        assert report.source == "disk" and report.fallback_reason == busy
        assert FALLBACK.format(reason=busy) in caplog.text
        daemon.wait_for_log(f"(busy): {DAEMON_ERRORS['busy'].format(max=MAX_CLIENTS)}", timeout=10)

        # Without fallback the engine waits (busy is worth waiting for) and gets in once slots free up.
        got = {}
        waiter = threading.Thread(target=lambda: got.update(
            r=load_weights(cfg, "ipc_cache", LoaderConfig(socket_path=str(sock), fallback=False, state_timeout_s=60))))
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive(), "the engine should still be waiting for a free slot"
    finally:
        for s in idle:
            s.close()
    waiter.join(60)
    assert got["r"].report.source == "the weight cache (zero_copy)"
    got["r"].close()
    assert settle(rank, threads, thread_count) == 0
    check_daemon(daemon, rank, ports)


def test_10000_malformed_frames_on_the_daemon_socket(daemon, rank, sock, lease, ports):
    TALLY.fault("malformed, truncated, oversize, wrong-version and wrong-type frames (daemon socket)",
                "descriptors attached to frames")
    rng = random.Random(SEED)
    r, w = os.pipe()  # what the fuzzer attaches as SCM_RIGHTS: the daemon must close every copy
    fds, threads = fd_count(rank), thread_count(rank)
    frames = malformed = 0
    labels: dict[str, int] = {}
    t0 = time.monotonic()
    try:
        while malformed < MALFORMED:
            plan = connection_plan(rng)
            last = plan[-1] if plan[-1].expect == "protocol" else None
            first = b"".join(f.data for f in (plan[:-1] if last else plan))
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(sock))
                replies = exchange(s, first, last.data if last else b"", [r] * last.fds if last and last.fds else ())
            check_replies(plan, replies)
            frames += len(plan)
            malformed += last is not None
            for f in plan:
                labels[f.label] = labels.get(f.label, 0) + 1
            if frames % 2000 < len(plan) and not alive(rank):
                break
    finally:
        os.close(r), os.close(w)
        TALLY.frames += frames
        TALLY.malformed += malformed
    seconds = time.monotonic() - t0
    print(f"daemon socket: {frames} frames ({malformed} malformed) in {seconds:.1f} s; " +
          ", ".join(f"{k}: {v}" for k, v in sorted(labels.items())))
    check_daemon(daemon, rank, ports)
    leaked = settle(rank, fds)
    TALLY.leaked_fds += leaked
    assert leaked == 0, f"the daemon kept {leaked} descriptor(s)"
    assert settle(rank, threads, thread_count) == 0, "connection threads outlived their connections"
    assert call(sock, "get_memory")["zero_copy_engines"] == 1 and call(sock, "get_memory")["released"] is False


def seed_ask(port: int, data: bytes) -> list[dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        return exchange(s, data)


def test_the_seed_token_check_is_constant_time():
    """The token is compared as SHA-256 digests with hmac.compare_digest (so neither its content nor
    its length shows in the timing), and nothing else compares a token."""
    tree = ast.parse(inspect.getsource(seed))
    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "hmac.compare_digest"]
    assert [ast.unparse(n) for n in compares] == ["hmac.compare_digest(_digest(req.get('token')), self.token_digest)"]
    assert "hashlib.sha256" in inspect.getsource(seed._digest)
    assert "self.token_digest = _digest(token)" in inspect.getsource(seed.SeedServer.__init__)
    for node in ast.walk(ast.parse(inspect.getsource(seed.SeedServer))):  # the server compares no token
        if isinstance(node, ast.Compare):
            assert "token" not in ast.unparse(node).replace("token_digest", ""), ast.unparse(node)


def test_fuzzed_frames_and_bad_tokens_on_the_seed_listener(daemon, rank, sock, ports):
    TALLY.fault("malformed frames on the seed listener", "bad seed tokens (constant time, delayed, rate-limited)",
                "more connections than the seed listener serves")
    port = ports["seed"]
    rng = random.Random(SEED + 1)
    fds, threads = fd_count(rank), thread_count(rank)
    frames = 0
    # 1. Frames that fail before the token is looked at: each answered "protocol" with its reason.
    #    None of them counts as a bad token.
    for _ in range(SEED_MALFORMED):
        bad = terminal(rng, max_bytes=seed.MAX_REQUEST_BYTES, frame_level=True)
        [answer] = seed_ask(port, bad.data)
        assert answer["ok"] is False and answer["error"] == "protocol", (bad.label, answer)
        assert bad.message is None or bad.message in answer["message"], (bad.label, bad.message, answer)
        frames += 1
    # 2. The right token: the read-only fetches answer, anything else is forbidden.
    assert seed_ask(port, frame(request("ping", token=TOKEN))) == [{"v": 1, "ok": True, "rank": 0, "has_cache": False}]
    for _ in range(300):
        op = rng.choice(["get_autotune", "get_weights", "release", "get_state", "put_autotune", "shutdown", None, 7,
                         ["ping"]])
        obj = request(op, token=TOKEN)
        if rng.random() < 0.5:
            obj["key"] = rng.choice([{}, {"dtype": "x"}, [], "key", None, 1])
        if op == "get_weights" and rng.random() < 0.5:
            obj["small"] = rng.choice([{}, {"shards": "x"}, [], None])
        [answer] = seed_ask(port, frame(obj))
        if op == "get_autotune":
            expected = "no_cache" if isinstance(obj.get("key"), dict) else "protocol"
        elif op == "get_weights":  # a key and small files that are objects: checked, and not this daemon's
            expected = "mismatch" if isinstance(obj.get("key"), dict) and isinstance(obj.get("small"), dict) else "protocol"
        else:
            expected = "forbidden"
        assert answer["error"] == expected, (obj, answer)
        frames += 1
    # 3. More connections than it serves: the one over the limit is told why.
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(seed.MAX_CONNECTIONS)]
    try:
        wait_until(lambda: thread_count(rank) >= threads + seed.MAX_CONNECTIONS, 10, "the seed listener to fill up")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            over = split_replies(s.recv(4096))
        assert over == [{"v": 1, "ok": False, "error": "busy", "message": SEED_BUSY.format(max=seed.MAX_CONNECTIONS)}]
    finally:
        for s in idle:
            s.close()
    wait_until(lambda: thread_count(rank) <= threads, 15, "the idle seed connections to end")
    # 4. Bad tokens of every type: each refused only after the delay, then this peer is rate-limited
    #    for the window, the right token included.
    bad_tokens = [TOKEN[:-1] + "X", TOKEN + "0", "\ud800" * 20, 12345, ["x"], None, "", TOKEN.upper()]
    for token in bad_tokens[: seed.BAD_TOKEN_LIMIT]:
        t = time.monotonic()
        obj = request("ping") if token is None else request("ping", token=token)
        [answer] = seed_ask(port, frame(obj))
        assert answer["error"] == "token" and time.monotonic() - t >= seed.BAD_TOKEN_DELAY_S, (token, answer)
        frames += 1
    for data in [frame(request("ping", token=bad_tokens[-1])), frame(request("ping", token=TOKEN))] + \
            [terminal(rng, max_bytes=seed.MAX_REQUEST_BYTES, frame_level=True).data for _ in range(200)]:
        t = time.monotonic()
        assert [a["error"] for a in seed_ask(port, data)] == ["rate_limited"]
        assert time.monotonic() - t < seed.BAD_TOKEN_DELAY_S  # refused before reading: no delay to wait out
        frames += 1
    TALLY.frames += frames
    TALLY.malformed += SEED_MALFORMED
    daemon.wait_for_log("Seed request from 127.0.0.1 with a bad token refused", timeout=5)
    check_daemon(daemon, rank, ports)
    leaked = settle(rank, fds)
    TALLY.leaked_fds += leaked
    assert leaked == 0 and settle(rank, threads, thread_count) == 0


def test_release_under_an_idle_zero_copy_lease_is_refused(daemon, rank, sock, lease, ports):
    """The lease is the engine's open connection, however long the engine stays quiet: past the
    daemon's request timeout a release is still refused with its message."""
    TALLY.fault("release while another engine holds a zero_copy mapping")
    left = lease.t0 + REQUEST_TIMEOUT_S + 2 - time.monotonic()
    if left > 0:
        time.sleep(left)
    assert call(sock, "get_memory")["zero_copy_engines"] == 1
    in_use = DAEMON_ERRORS["in_use"].format(n=1)
    assert in_use == "release refused: 1 engine(s) still map the weights in zero_copy mode"
    assert call(sock, "release") == {"v": 1, "ok": False, "error": "in_use", "message": in_use}
    daemon.wait_for_log(f"Refused request 'release' from pid {os.getpid()} (in_use): {in_use}", timeout=5)
    memory = call(sock, "get_memory")
    assert memory["released"] is False and memory["weights_bytes"] > 0
    check_daemon(daemon, rank, ports)


def test_after_everything_a_real_engine_still_gets_bit_identical_weights(daemon, rank, sock, cfg, ports):
    weights, report, lease = load_weights(cfg, "ipc_cache", LoaderConfig(socket_path=str(sock), fallback=False))
    disk, _, _lease = load_weights(cfg, "safetensors")
    try:
        assert report.source == "the weight cache (zero_copy)"
        outputs = []
        for w in (weights, disk):
            model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), w.bindable())
            outputs.append(model(torch.tensor(PROMPT), 0, model.new_cache(len(PROMPT))))
        assert torch.equal(*outputs)
    finally:
        lease.close()
    check_daemon(daemon, rank, ports)
