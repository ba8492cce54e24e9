"""Seeding the autotune cache between daemons, with real processes and real TCP: a seeded replica runs
no trial; a wrong token, an unreachable seed and another configuration each log their own message
and tune locally; the source refuses to listen without a token. The server's defences (token
first, read-only commands, bounded sizes, rate limiting of bad tokens) are probed in-process over
real sockets."""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
from pathlib import Path

import pytest
from procs import READY, free_port
from wcache.core import autotune
from wcache.daemon import seed
from wcache.cli import main as cli_main
from wcache.core.config import EngineConfig
from wcache.errors import SEED_FALLBACK, SEED_REASONS, SEEDED, SeedConfigError
from wcache.wire.protocol import recv_frame, request, send_frame

TOKEN = "s3cr3t-token-for-tests-0123456789"
TRIALS = re.compile(r"\[Autotuner\]: (\d+) tuning trials in this process")


# These tests are about where the cache lives and who tunes: each process uses its own cache root.
pytestmark = pytest.mark.usefixtures("own_autotune_cache")


def replica(procs, model, tmp_path: Path, name: str, *flags: str):
    """A second daemon on this host: its own socket dir and cache root (as on another machine)."""
    sock_dir, root = Path(procs.env["TMPDIR"]) / f"s-{name}", tmp_path / f"root-{name}"  # sun_path is short
    sock_dir.mkdir(mode=0o700)
    return procs.preload(model, "--weight-cache-socket-dir", str(sock_dir), *flags, ready=False, name=name,
                         env={"WCACHE_CACHE_ROOT": str(root)})


def trials(log: str) -> list[int]:
    return [int(n) for n in TRIALS.findall(log)]


def test_seeded_replica_runs_no_trial_and_each_failure_tunes_locally(procs, tiny_model, tmp_path):
    base = free_port()
    source = procs.preload(tiny_model, "--weight-cache-seed-listen", f"127.0.0.1:{base}",
                           "--weight-cache-seed-token", TOKEN)
    assert f"Rank 0 serves its autotune cache to seeding replicas on 127.0.0.1:{base}" in source.log()
    address = f"127.0.0.1:{base}"  # BASE_PORT + global rank 0
    dead = f"127.0.0.1:{free_port()}"
    # Four replicas at once: seeded, wrong token, unreachable seed, another configuration (dtype).
    ok = replica(procs, tiny_model, tmp_path, "ok", "--weight-cache-seed", address, "--weight-cache-seed-token", TOKEN)
    bad = replica(procs, tiny_model, tmp_path, "bad", "--weight-cache-seed", address,
                  "--weight-cache-seed-token", "a-wrong-token-of-enough-length")
    gone = replica(procs, tiny_model, tmp_path, "gone", "--weight-cache-seed", dead, "--weight-cache-seed-token", TOKEN)
    other = replica(procs, tiny_model, tmp_path, "other", "--dtype", "float32", "--weight-cache-seed", address,
                    "--weight-cache-seed-token", TOKEN)
    for p in (ok, bad, gone, other):
        p.wait_for_log(READY)

    log = ok.log()
    assert SEEDED.format(address=address, n=8) in log
    assert "[Autotuner]: Loaded 8 configs from" in log and trials(log) == [0] and "Tuned" not in log
    src_doc = json.loads(next((Path(procs.env["WCACHE_CACHE_ROOT"]) / "autotune").glob("*.json")).read_text())
    ok_doc = json.loads(next((tmp_path / "root-ok" / "autotune").glob("*.json")).read_text())
    assert ok_doc["configs"] == src_doc["configs"] and ok_doc["seeded_from"] == address

    expect = {
        bad: SEED_REASONS["token"].format(address=address),
        gone: SEED_REASONS["unreachable"].format(address=dead, error="[Errno 111] Connection refused"),
        other: SEED_REASONS["mismatch"].format(address=address, fields="['dtype']"),
    }
    for p, reason in expect.items():
        log = p.log()
        assert SEED_FALLBACK.format(reason=reason) in log, log
        assert trials(log) == [40] and "Seeded" not in log
    assert "Seed request from 127.0.0.1 with a bad token refused" in source.log()


def test_listening_without_a_token_is_refused(tiny_model, wcache_env, capfd, monkeypatch):
    """Refused by the launcher before any rank starts (in-process: `wcache preload`'s main)."""
    monkeypatch.delenv(seed.TOKEN_ENV, raising=False)
    m = str(tiny_model)
    cases = [
        (["--weight-cache-seed-listen", "127.0.0.1:7000"], SeedConfigError.LISTEN_WITHOUT_TOKEN),
        (["--weight-cache-seed", "127.0.0.1:7000"], SeedConfigError.SEED_WITHOUT_TOKEN),
        (["--weight-cache-seed-listen", "127.0.0.1:7000", "--weight-cache-seed-token", "short"],
         SeedConfigError.SHORT_TOKEN.format(min=16)),
        (["--weight-cache-seed-listen", "localhost", "--weight-cache-seed-token", TOKEN],
         SeedConfigError.BAD_ADDRESS.format(flag="--weight-cache-seed-listen", value="localhost")),
        (["--weight-cache-seed", "127.0.0.1:7000,127.0.0.1:7001", "--weight-cache-seed-token", TOKEN],
         SeedConfigError.COUNT.format(given=2, ranks=1)),
        (["--weight-cache-seed-listen", "127.0.0.1:7000", "--weight-cache-seed-token", TOKEN,
          "--weight-cache-seed-round-replicas", "16"], SeedConfigError.BAD_ROUND_REPLICAS.format(value=16, max=15)),
    ]
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        for flags, message in cases:
            assert cli_main(["preload", "--model", m, "--device", "cpu", *flags]) == 2
            err = capfd.readouterr().err
            assert message in err and "Weight cache daemon" not in err, (flags, err)
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


@pytest.fixture
def server(tiny_model, wcache_env):
    cfg = EngineConfig.build(str(tiny_model), device="cpu")
    doc, _, _ = autotune.load_or_tune(cfg, "test")
    srv = seed.SeedServer("127.0.0.1", free_port(), TOKEN, lambda: doc, 0).start()
    srv.key = autotune.tune_key(cfg)
    srv.doc = doc
    yield srv
    srv.close()


def ask(srv, obj: dict) -> dict:
    host, port = srv.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        send_frame(s, obj)
        return recv_frame(s)[0]


def test_seed_server_serves_read_only_fetches_after_the_token(server):
    assert seed.fetch(server.address, TOKEN, server.key) == server.doc
    assert ask(server, request("ping", token=TOKEN)) == {"v": 1, "ok": True, "rank": 0, "has_cache": True}
    # Anything but the fetches is refused, even with the right token.
    for op in ("release", "get_state", "put_autotune", None):
        answer = ask(server, request(op, token=TOKEN))
        assert answer["error"] == "forbidden" and "only ['ping', 'get_autotune', 'get_weights']" in answer["message"]
    # A server given no weights (this one) refuses to send any.
    answer = ask(server, request("get_weights", token=TOKEN, key=server.key, small={}))
    assert answer["error"] == "forbidden" and answer["message"] == "this daemon serves no weights"
    # Without the token nothing is looked at: an unknown command gets the token error, not "forbidden".
    assert ask(server, request("shutdown"))["error"] == "token"
    assert ask(server, request("get_autotune", token=12345, key=server.key))["error"] == "token"
    mismatch = ask(server, request("get_autotune", token=TOKEN, key={**server.key, "tp_rank": 1}))
    assert mismatch["error"] == "mismatch" and mismatch["fields"] == ["tp_rank"]


def test_seed_server_bounds_requests_and_rate_limits_bad_tokens(server):
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:  # a huge length prefix
        s.sendall(struct.pack(">Q", 1 << 40))
        answer = recv_frame(s)[0]
    assert answer["error"] == "protocol" and "exceeds the maximum of 65536" in answer["message"]
    with socket.create_connection((host, int(port)), timeout=5) as s:  # a pickle is not JSON
        body = b"\x80\x04\x95" + b"x" * 20
        s.sendall(struct.pack(">Q", len(body)) + body)
        assert recv_frame(s)[0]["error"] == "protocol"
    # Bad tokens: the first BAD_TOKEN_LIMIT get "token", then the peer is refused for the window,
    # even with the right token.
    answers = [ask(server, request("ping", token=f"wrong-{i}"))["error"] for i in range(seed.BAD_TOKEN_LIMIT + 1)]
    assert answers == ["token"] * seed.BAD_TOKEN_LIMIT + ["rate_limited"]
    assert ask(server, request("ping", token=TOKEN))["error"] == "rate_limited"
    with pytest.raises(seed.SeedFailure) as e:
        seed.fetch(server.address, TOKEN, server.key)
    assert str(e.value) == SEED_REASONS["rate_limited"].format(address=server.address)
