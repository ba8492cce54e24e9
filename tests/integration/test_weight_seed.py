"""Weight seeding with real daemons, engines and TCP on loopback: a replica without shards takes its
weights from a running daemon and its engine answers token for token as the source's engine; a
replica with shards seeds when asked and falls back to them on a failed seed; a replica without
shards exits 2 on one; three replicas at once form one fan-out round in which the source sends the
arena about once."""

from __future__ import annotations

import re
from pathlib import Path

from procs import READY, free_port, http
from wcache.bench.seeding import small_files  # every file but the shards
from wcache.errors import (
    SEED_WEIGHTS_FALLBACK,
    SEED_WEIGHTS_FATAL,
    SEED_WEIGHTS_REASONS,
)

TOKEN = "weights-token-for-tests-0123456789"
SEEDED = re.compile(r"Rank 0 weights: seeded from (\S+) \((\d+) tensors, .*, (TCP stream|fan-out round of (\d+) ranks), "
                    r"(\d+) bytes sent by this daemon\), digests checked")
ROUND = re.compile(r"Seeding round (\d+): (\d+) replica\(s\) of rank 0 served by (.*?) in [\d.]+ s; (\d+) bytes sent by "
                   r"this daemon for (\d+) bytes of arena")
PROMPTS = ["Hello", "The weight cache", "1 2 3 4"]


def source(procs, model, *flags: str):
    base = free_port()
    p = procs.preload(model, "--weight-cache-seed-listen", f"127.0.0.1:{base}", "--weight-cache-seed-token", TOKEN,
                      *flags)
    return p, f"127.0.0.1:{base}"


def replica(procs, model, tmp_path: Path, name: str, address: str, *flags: str, token: str = TOKEN):
    """A daemon with its own socket dir and cache root, as on another machine."""
    sock_dir, root = Path(procs.env["TMPDIR"]) / f"s-{name}", tmp_path / f"root-{name}"
    sock_dir.mkdir(mode=0o700)
    p = procs.preload(model, "--weight-cache-socket-dir", str(sock_dir), "--weight-cache-seed", address,
                      "--weight-cache-seed-token", token, *flags, ready=False, name=name,
                      env={"WCACHE_CACHE_ROOT": str(root)})
    p.sock_dir, p.root = sock_dir, root
    return p


def tokens(port: int) -> list[str]:
    out = []
    for prompt in PROMPTS:
        status, body = http("POST", f"http://127.0.0.1:{port}/v1/completions",
                            {"prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert status == 200, body
        out.append(body["choices"][0]["text"])
    return out


def test_a_replica_without_shards_serves_the_sources_tokens(procs, tiny_model, tmp_path):
    src, address = source(procs, tiny_model, "--weight-cache-seed-round-window", "0")
    bare = small_files(tiny_model, tmp_path / "bare")
    rep = replica(procs, bare, tmp_path, "bare", address).wait_for_log(READY)
    m = SEEDED.search(rep.log())
    assert m and m.group(1) == address and m.group(3) == "TCP stream", rep.log()
    assert TOKEN not in rep.log() + src.log()  # never logged, on either side
    rounds = ROUND.findall(src.log())
    assert len(rounds) == 1 and rounds[0][2] == "one TCP stream"
    assert "Replica at 127.0.0.1 checked the seeded weights of rank 0" in src.log()

    # The replica's engine: no shard anywhere, ipc_cache without fallback, the same tokens.
    loader = '{"socket_dir": "%s", "fallback": false}' % rep.sock_dir
    mine = procs.serve(bare, "--load-format", "ipc_cache", "--model-loader-extra-config", loader,
                       env={"WCACHE_CACHE_ROOT": str(rep.root)})
    theirs = procs.serve(tiny_model, "--load-format", "ipc_cache")
    assert tokens(mine.port) == tokens(theirs.port)
    assert "falling back to disk loading" not in mine.log()


def test_a_replica_with_shards_seeds_when_asked_and_falls_back_to_them(procs, tiny_model, tmp_path):
    _, address = source(procs, tiny_model, "--weight-cache-seed-round-window", "0")
    asked = replica(procs, tiny_model, tmp_path, "asked", address, "--weight-cache-seed-weights", "always")
    wrong = replica(procs, tiny_model, tmp_path, "wrong", address, "--weight-cache-seed-weights", "always",
                    token="a-wrong-token-of-enough-length")
    own = replica(procs, tiny_model, tmp_path, "own", address)  # auto, with shards: its disk
    for p in (asked, wrong, own):
        p.wait_for_log(READY)
    assert SEEDED.search(asked.log()), asked.log()
    reason = SEED_WEIGHTS_REASONS["token"].format(address=address)
    assert SEED_WEIGHTS_FALLBACK.format(reason=reason) in wrong.log()
    assert "Rank 0 weights: read from the checkpoint's shards (seeding failed: token)" in wrong.log()
    assert not SEEDED.search(own.log()) and "Seeded the autotune cache" in own.log()


def test_a_replica_without_shards_exits_2_when_the_seed_fails(procs, tiny_model, tmp_path):
    _, address = source(procs, tiny_model, "--weight-cache-seed-round-window", "0")
    bare = small_files(tiny_model, tmp_path / "bare")
    other = replica(procs, bare, tmp_path, "other", address, "--dtype", "float32")
    assert other.exit_code(timeout=120) == 2
    reason = SEED_WEIGHTS_REASONS["mismatch"].format(address=address, fields="['dtype']")
    assert SEED_WEIGHTS_FATAL.format(reason=reason) in other.log()
    assert "serving on" not in other.log()


def test_three_replicas_at_once_form_one_round_and_the_source_sends_the_arena_once(procs, tiny_model, tmp_path):
    src, address = source(procs, tiny_model, "--weight-cache-seed-round-window", "8")
    bare = small_files(tiny_model, tmp_path / "bare")
    reps = [replica(procs, bare, tmp_path, f"r{i}", address) for i in range(3)]
    for p in reps:
        p.wait_for_log(READY, timeout=180)
        m = SEEDED.search(p.log())
        assert m and m.group(4) == "4", p.log()
    (_, replicas, how, sent, size), = ROUND.findall(src.log())
    assert replicas == "3" and how.startswith("a gloo scatter + ring all-gather")
    # gloo's broadcast (a binomial tree) would send it twice for 4 ranks; a relay per replica 3 times.
    assert int(size) <= int(sent) <= 1.1 * int(size), (sent, size)


def test_a_round_of_the_expected_size_starts_without_waiting_out_its_window(procs, tiny_model, tmp_path):
    # A window of 10 minutes: READY within the wait below only if the round started once both asked.
    src, address = source(procs, tiny_model, "--weight-cache-seed-round-window", "600",
                          "--weight-cache-seed-round-replicas", "2")
    bare = small_files(tiny_model, tmp_path / "bare")
    reps = [replica(procs, bare, tmp_path, f"x{i}", address) for i in range(2)]
    for p in reps:
        p.wait_for_log(READY, timeout=240)
        m = SEEDED.search(p.log())
        assert m and m.group(4) == "3", p.log()
    (_, replicas, how, sent, size), = ROUND.findall(src.log())
    assert replicas == "2" and int(size) <= int(sent) <= 1.1 * int(size), (replicas, sent, size)
