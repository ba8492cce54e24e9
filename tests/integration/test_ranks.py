"""Parallel ranks with real processes: `wcache preload` with TP/PP/DP, two "nodes" on one machine,
the speculative draft group, startup failure, SIGTERM and /health; `wcache serve` with one worker
process per rank mapping its shard from its own daemon.

Checkpoints are float32 so that TP=2's reordered all-reduce sums cannot flip a greedy token (the
logits tolerance itself is tested in test_ranks_engine.py). Autotune is off: it is not what these
tests are about, and each rank would spend seconds tuning.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from http.client import HTTPException
from pathlib import Path

import pytest
import torch
from procs import _healthy, alive, child_pids, complete, engine_workers, free_port, http, two_processes, wait_until
import prompt_ids as tokenizer
from wcache.core.checkpoint import make_checkpoint
from wcache.core.config import EngineConfig, Ranks
from wcache.core.device import device_identity
from wcache.core.disk import load_processed
from wcache.daemon.launcher import STARTUP_FAILED
from wcache.engine.loading.config import LoaderConfig
from wcache.engine.loading.ipc_cache import IpcCacheLoader
from wcache.model.llama import bind_weights, build_meta_model, generate
from wcache.wire.handback import OFFER_PREFIX
from wcache.wire.sockets import DaemonLock, prepare_socket_dir, socket_name
from wcache.engine.worker.supervisor import WORKERS_EXITED
from wcache.errors import ENGINE_DEAD, DaemonLockError

NO_TUNE = "--no-enable-autotune"
PROMPT = "Hello"
TOKENS = 12


@pytest.fixture(autouse=True)
def stop_together(procs):
    """Signal every process of a test at once at teardown (each takes a second or two to exit)."""
    yield
    for p in procs.started:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ranks") / "tiny32", "tiny", dtype="float32")


@pytest.fixture(scope="module")
def draft32(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ranks") / "draft32", "tiny", seed=1, dtype="float32")


@pytest.fixture(scope="module")
def expected(model32) -> list[int]:
    """TP=1 greedy tokens, computed in this process from disk."""
    cfg = EngineConfig.build(str(model32), device="cpu")
    model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), load_processed(cfg, False).bindable())
    return generate(model, tokenizer.preset_encode(PROMPT), TOKENS, tokenizer.EOS_ID)  # as tiny/tokenizer.json encodes it


def tokens(port: int) -> list[int]:
    return complete(port, PROMPT, TOKENS)["choices"][0]["token_ids"]


def loader_json(**kw) -> str:
    return json.dumps({"fallback": False, "state_timeout_s": 60, **kw})


def cached_weights(model, r: Ranks, draft: bool = False, socket_dir=None) -> dict[str, torch.Tensor]:
    """One rank's tensors as its daemon serves them (mapped into this process, then copied)."""
    cfg = EngineConfig.build(str(model), device="cpu", ranks=r)
    lc = LoaderConfig(fallback=False, state_timeout_s=10, socket_dir=str(socket_dir) if socket_dir else None)
    weights, _, lease = IpcCacheLoader(lc, draft).load(cfg)
    out = {n: t.clone() for n, t in weights.bindable().items()}
    lease.close()
    return out


def assert_daemon_holds_its_shard(model, r: Ranks, **kw) -> dict[str, torch.Tensor]:
    got = cached_weights(model, r, **kw)
    want = load_processed(EngineConfig.build(str(model), device="cpu", ranks=r), False).bindable()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want), f"rank {r} serves other bytes than its shard"
    return got


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (exited, not reaped yet) counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_tp2_shards_serve_health_and_sigterm(procs, model32, expected, wcache_env):
    health = free_port()
    pre = procs.preload(model32, "-tp", "2", NO_TUNE, "--weight-cache-health-port", str(health),
                        "--weight-cache-health-host", "127.0.0.1")
    log = pre.log()
    assert "node 0/1 serves global rank(s) 0 to 1 of 2 (tp=2, pp=1, dp=1)" in log
    assert log.count("joined the daemon world of 2") == 2
    sockets = [prepare_socket_dir(None, create=False) / socket_name(device_identity("cpu", i)) for i in range(2)]
    assert "READY (2 rank(s) in" in log and all(str(s) in log for s in sockets)
    # Each rank holds exactly its TP slice: half the heads and half the MLP columns of every layer.
    shards = [assert_daemon_holds_its_shard(model32, Ranks(tp_size=2, tp_rank=i, local_rank=i)) for i in range(2)]
    assert shards[0]["layers.0.attn.qkv.weight"].shape == (128, 128)  # (2 q + 1 k + 1 v heads) x 32
    assert not torch.equal(shards[0]["layers.0.attn.qkv.weight"], shards[1]["layers.0.attn.qkv.weight"])

    engine = procs.serve(model32, "-tp", "2", "--master-port", str(free_port()), NO_TUNE,
                         "--load-format", "ipc_cache", "--model-loader-extra-config", loader_json())
    assert engine.log().count("Mapped 27 tensors from the weight cache daemon (zero_copy mode)") == 2
    assert tokens(engine.port) == expected
    # An engine rank that dies turns the engine's /health to 503, as a daemon rank does the launcher's.
    (worker,) = engine_workers(engine.pid)
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: http("GET", f"http://127.0.0.1:{engine.port}/health")[0] == 503, what="engine /health 503")
    assert WORKERS_EXITED.format(codes={1: -9}) in engine.log()
    assert engine.stop() == 0

    daemons = child_pids(pre.pid)
    assert len(daemons) == 2 and http("GET", f"http://127.0.0.1:{health}/health")[0] == 200
    os.kill(daemons[1], signal.SIGKILL)
    wait_until(lambda: http("GET", f"http://127.0.0.1:{health}/health")[0] == 503, what="/health 503")
    pre.wait_for_log("/health now answers 503", timeout=30)  # /health may turn before the line is written
    assert pre.stop(signal.SIGTERM) == 0
    assert gone(daemons[0]) and not sockets[0].exists()


def test_a_dead_engine_loop_ends_the_server_with_status_1(procs, model32, expected):
    """A rank killed under an engine of two: the next request's pass fails on the lost peer, the
    engine loop ends for good, and the server exits 1 with ENGINE_DEAD's line rather than staying
    up with a loop that will never step again (a supervisor or the kubelet then starts a new one).
    The break it catches: without the engine's failure watched (server.py's run_until_signal),
    the process stays up after the loop died and this test times out waiting for its exit."""
    engine = procs.serve(model32, "-tp", "2", "--master-port", str(free_port()), NO_TUNE)
    assert tokens(engine.port) == expected
    (worker,) = engine_workers(engine.pid)  # rank 1: the engine core's child with two processes
    os.kill(worker, signal.SIGKILL)
    try:  # an error answer, or the connection closed as the server exits
        status, _ = http("POST", f"http://127.0.0.1:{engine.port}/v1/completions",
                         {"prompt": PROMPT, "max_tokens": TOKENS}, timeout=60)
    except (OSError, HTTPException):
        status = None
    assert status != 200
    try:
        code = engine.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = f"still running after 60 s, with children {child_pids(engine.pid)}"
    assert code == 1, engine.log()[-4000:]
    log = engine.log()
    assert "Engine rank 0 lost contact with the other ranks" in log, log[-3000:]
    dead = ENGINE_DEAD.split("({error})")
    assert dead[0] in log and dead[1] in log, log[-3000:]


def test_tp2_daemon_restart_each_rank_adopts_its_own_shard(procs, model32, expected):
    pre = procs.preload(model32, "-tp", "2", NO_TUNE)
    engine = procs.serve(model32, "-tp", "2", "--master-port", str(free_port()), NO_TUNE,
                         "--load-format", "ipc_cache", "--model-loader-extra-config", loader_json())
    assert tokens(engine.port) == expected
    assert pre.stop(signal.SIGTERM) == 0  # an upgrade: both ranks stop, both engine ranks keep serving
    wait_until(lambda: engine.log().count("offers them to the next daemon") == 2, what="both engine ranks to offer")
    assert tokens(engine.port) == expected

    again = procs.preload(model32, "-tp", "2", NO_TUNE)
    log = again.log()
    assert all(f"Rank {r} adopted the arena of a running engine" in log for r in (0, 1)), log
    assert "loaded 27 tensors" not in log  # neither rank read the checkpoint
    wait_until(lambda: engine.log().count("Leased the weights again") == 2, what="both engine ranks to lease again")
    assert tokens(engine.port) == expected
    # Each daemon rank serves its own shard again (the cache key holds the rank, so shards cannot swap).
    for i in range(2):
        assert_daemon_holds_its_shard(model32, Ranks(tp_size=2, tp_rank=i, local_rank=i))


def test_pp2_stages_hold_their_layers(procs, model32, expected):
    procs.preload(model32, "-pp", "2", NO_TUNE)
    first = assert_daemon_holds_its_shard(model32, Ranks(pp_size=2, pp_rank=0, local_rank=0))
    last = assert_daemon_holds_its_shard(model32, Ranks(pp_size=2, pp_rank=1, local_rank=1))
    assert "embed.weight" in first and "lm_head.weight" not in first
    assert {n.split(".")[1] for n in first if n.startswith("layers.")} == {"0", "1"}
    assert {n.split(".")[1] for n in last if n.startswith("layers.")} == {"2", "3"}
    assert "lm_head.weight" in last and "norm.weight" in last and "embed.weight" not in last
    engine = procs.serve(model32, "-pp", "2", "--master-port", str(free_port()), NO_TUNE,
                         "--load-format", "ipc_cache", "--model-loader-extra-config", loader_json())
    assert engine.log().count("Mapped") == 2
    assert tokens(engine.port) == expected


def test_dp2_daemons_and_one_engine_per_dp_rank(procs, model32, expected):
    procs.preload(model32, "-dp", "2", NO_TUNE)
    replicas = [assert_daemon_holds_its_shard(model32, Ranks(dp_size=2, dp_rank=i, local_rank=i)) for i in range(2)]
    assert all(torch.equal(replicas[0][n], replicas[1][n]) for n in replicas[0])  # DP ranks: the same weights
    engines = [procs.serve(model32, "-dp", "2", "--data-parallel-rank", str(i), NO_TUNE, "--load-format",
                           "ipc_cache", "--model-loader-extra-config", loader_json(), ready=False) for i in range(2)]
    for i, e in enumerate(engines):
        e.wait_for(lambda port=e.port: _healthy(port), what="/health 200")
        assert "Mapped 27 tensors" in e.log() and f"local rank {i}" in e.log()
        assert tokens(e.port) == expected


def node_flags(node: int, *extra: str) -> list[str]:
    return ["-tp", "2", "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", *extra]


def test_tp2_across_two_nodes(procs, model32, expected, wcache_env):
    # Two "nodes" on one machine: each launcher has its own socket directory, as each node has its
    # own filesystem; both nodes' local rank 0 would otherwise claim the same CPU device identity.
    dirs = [Path(wcache_env["TMPDIR"]) / f"node{i}" for i in range(2)]
    wc_port, engine_port = free_port(), free_port()
    pres = [procs.preload(model32, *node_flags(i, "--weight-cache-master-port", str(wc_port),
                                               "--weight-cache-socket-dir", str(dirs[i]), NO_TUNE), ready=False)
            for i in range(2)]
    for i, p in enumerate(pres):
        p.wait_for_log("Weight cache daemon READY")
        assert f"node {i}/2 serves global rank(s) {i} to {i} of 2" in p.log()
        assert f"Rank {i} joined the daemon world of 2 at tcp://127.0.0.1:{wc_port}" in p.log()
    # Node 1's daemon holds TP rank 1 as its local rank 0, in node 1's directory.
    assert_daemon_holds_its_shard(model32, Ranks(tp_size=2, tp_rank=1, local_rank=0), socket_dir=dirs[1])
    engines = [procs.serve(model32, *node_flags(i, "--master-port", str(engine_port), NO_TUNE,
                                                "--load-format", "ipc_cache", "--model-loader-extra-config",
                                                loader_json(socket_dir=str(dirs[i]))), ready=False)
               for i in range(2)]
    engines[1].wait_for_log("Engine node 1 ready")
    engines[0].wait_for(lambda: _healthy(engines[0].port), what="/health 200")
    assert all("Mapped 27 tensors" in e.log() for e in engines)
    assert tokens(engines[0].port) == expected
    assert engines[0].stop() == 0
    engines[1].wait_for_log("Engine rank 1 stopping")
    assert engines[1].exit_code(30) == 0


def test_checkpoint_mismatch_across_nodes_fails_clearly(procs, model32, draft32, wcache_env):
    port = free_port()
    pres = [procs.preload(m, *node_flags(i, "--weight-cache-master-port", str(port), NO_TUNE,
                                         "--weight-cache-socket-dir", str(Path(wcache_env["TMPDIR"]) / f"n{i}")),
                          ready=False) for i, m in enumerate((model32, draft32))]
    for i, p in enumerate(pres):
        assert p.exit_code(90) == 2, p.log()
        assert "Checkpoint content differs across weight cache daemon ranks (rank(s) [0] have " in p.log()
        assert STARTUP_FAILED.format(codes={i: 2}) in p.log()


def test_draft_group_routes_the_draft_automatically(procs, model32, draft32, expected):
    spec = json.dumps({"method": "eagle", "model": str(draft32), "num_speculative_tokens": 3})
    pre = procs.preload(model32, "--speculative-config", spec, NO_TUNE)
    assert "roles: target + draft" in pre.log() and "_draft.sock" in pre.log()
    assert "READY (2 rank(s) in" in pre.log()
    assert_daemon_holds_its_shard(draft32, Ranks(), draft=True)
    engine = procs.serve(model32, "--speculative-config", spec, NO_TUNE, "--load-format", "ipc_cache",
                         "--model-loader-extra-config", loader_json())
    log = engine.log()
    assert log.count("Mapped 27 tensors from the weight cache daemon (zero_copy mode)") == 2
    assert "loaded 27 draft tensors (3.5 MiB) from the weight cache (zero_copy)" in log
    assert tokens(engine.port) == expected  # speculative decoding returns the target's greedy tokens
    engine.wait_for_log("Speculative decoding (eagle): accepted ")


def test_a_rank_that_fails_at_startup_takes_the_group_down(procs, model32, wcache_env):
    # Something answers at rank 1's socket path once the launcher has taken the locks (so this is
    # not another daemon): rank 1 refuses to replace it and fails; rank 0 is then stopped.
    d = prepare_socket_dir(None, create=True)
    path = d / socket_name(device_identity("cpu", 1))
    pre = procs.preload(model32, "-tp", "2", NO_TUNE, ready=False)
    wait_until(lambda: len(child_pids(pre.pid)) == 2, 60, "the launcher to start both ranks")
    ranks = child_pids(pre.pid)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        squatter.bind(str(path))
        squatter.listen(8)
        assert pre.exit_code(90) == 2
    finally:
        squatter.close()
        path.unlink(missing_ok=True)
    log = pre.log()
    assert DaemonLockError.LIVE_SOCKET.format(path=path) in log
    assert STARTUP_FAILED.format(codes={1: 2}) in log
    # Rank 0 was stopped by the launcher (in the daemons' rendezvous, waiting for rank 1, SIGTERM
    # ends it at once without a log line), and left no socket.
    assert not any(alive(pid) for pid in ranks)
    assert not (d / socket_name(device_identity("cpu", 0))).exists()
    assert "READY" not in log


def test_a_rank_whose_lock_is_held_fails_the_launcher_before_any_rank_starts(procs, model32, wcache_env):
    d = prepare_socket_dir(None, create=True)
    held = DaemonLock(d / socket_name(device_identity("cpu", 1)))
    held.acquire()
    try:
        pre = procs.preload(model32, "-tp", "2", NO_TUNE, ready=False)
        assert pre.exit_code(90) == 2
    finally:
        held.release()
    log = pre.log()
    assert DaemonLockError.TEMPLATE.format(path=d / socket_name(device_identity("cpu", 1))) in log
    assert "Rank 0" not in log and "exited during startup" not in log  # no rank was started
    rank0 = DaemonLock(d / socket_name(device_identity("cpu", 0)))
    rank0.acquire()  # the launcher let go of the lock it took for rank 0
    rank0.release()



def test_tp2_engine_samples_stops_and_streams_in_lockstep(procs, model32, expected):
    """Every rank draws the same sampled token (same seed, same logits), and stops where rank 0 stops
    (a stop string, a streaming client gone): the next request still finds the ranks in lockstep."""
    engine = procs.serve(model32, "-tp", "2", "--master-port", str(free_port()), NO_TUNE)
    url = f"http://127.0.0.1:{engine.port}/v1/completions"
    sampled = [http("POST", url, {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 1.5, "seed": 5})
               for _ in range(2)]
    assert sampled[0][0] == 200 and sampled[0][1]["choices"][0]["token_ids"] == sampled[1][1]["choices"][0]["token_ids"]
    greedy = complete(engine.port, PROMPT, TOKENS)["choices"][0]
    assert greedy["token_ids"] == expected
    stop = greedy["text"][3:5]
    status, body = http("POST", url, {"prompt": PROMPT, "max_tokens": TOKENS, "stop": stop})
    assert status == 200 and body["choices"][0]["text"] == greedy["text"][:greedy["text"].find(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    with socket.create_connection(("127.0.0.1", engine.port), timeout=30) as s:  # a client that leaves
        body = json.dumps({"prompt": PROMPT, "max_tokens": TOKENS, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert s.recv(1 << 16).startswith(b"HTTP/1.1 200 ")
    assert tokens(engine.port) == expected


def offers_in(socket_dir: Path) -> set[str]:
    return {p.name for p in socket_dir.iterdir() if p.name.startswith(OFFER_PREFIX)}


def offer_of(log: str, rank: int) -> str:
    """The offer socket's name an engine rank logged when its daemon (rank ``rank``) went away."""
    daemon = socket_name(device_identity("cpu", rank))
    [line] = [ln for ln in log.splitlines() if f"{daemon} went away" in ln]
    return Path(line.rstrip().split()[-1]).name


def test_engine_ranks_that_offered_withdraw_their_offers_when_stopped(procs, model32, expected):
    """Daemons stopped first: both engine ranks offer their arenas in the socket directory. A SIGTERM
    to the engine's process group (`kill -- -$ENGINE`) then leaves no offer behind: the serve process
    closes its leases; the worker, whose main thread waits inside a collective, withdraws its offer
    on SIGTERM and still dies by it. A SIGKILLed serve process cannot withdraw its own offer (the
    next daemon removes it as stale), but its worker, signalled by PDEATHSIG, withdraws its own. With
    two processes (the default) the SIGKILLed process is the front: the engine core (rank 0) sees its
    channel close and stops, withdrawing its offer too."""
    socket_dir = prepare_socket_dir(None, create=False)
    for stop in ("group SIGTERM", "serve SIGKILL"):
        pre = procs.preload(model32, "-tp", "2", NO_TUNE)
        engine = procs.serve(model32, "-tp", "2", "--master-port", str(free_port()), NO_TUNE,
                             "--load-format", "ipc_cache", "--model-loader-extra-config", loader_json())
        assert tokens(engine.port) == expected
        (worker,) = engine_workers(engine.pid)
        assert pre.stop(signal.SIGTERM) == 0
        wait_until(lambda: engine.log().count("offers them to the next daemon") == 2, what="both engine ranks to offer")
        offered = {offer_of(engine.log(), r) for r in (0, 1)}
        assert offered <= offers_in(socket_dir)
        assert tokens(engine.port) == expected  # both ranks serve on from the memory they map

        if stop == "group SIGTERM":
            os.killpg(engine.pid, signal.SIGTERM)
            assert engine.exit_code(60) == 0
            wait_until(lambda: gone(worker), what="the worker to exit")
            assert not offered & offers_in(socket_dir), f"left behind: {offered & offers_in(socket_dir)}"
        else:
            os.kill(engine.pid, signal.SIGKILL)
            assert engine.exit_code(60) == -signal.SIGKILL
            wait_until(lambda: gone(worker), what="the worker to exit on PDEATHSIG")
            if two_processes():  # the front killed: the engine core (rank 0) sees its channel close
                # and stops as on SIGTERM, withdrawing its own offer too
                wait_until(lambda: not offers_in(socket_dir) & offered, what="rank 0's offer withdrawn")
            else:
                assert offers_in(socket_dir) & offered == {offer_of(engine.log(), 0)}  # the serve process's own
                (socket_dir / offer_of(engine.log(), 0)).unlink()
