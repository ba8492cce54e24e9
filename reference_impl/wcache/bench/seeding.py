"""`wcache bench --seed`: weight seeding against a raw TCP copy of the same bytes, one replica against
several, and against a replica that reads its own shards, measured in one run on loopback.

Real daemons throughout: a source (`wcache preload --weight-cache-seed-listen`) and replicas whose
model directories hold every file of the checkpoint but the shards, each with its own socket
directory and cache root, as on other hosts. Each repeat takes every measurement once, in turn (the
medians are recorded, every sample under ``samples``), so that the host's other work weighs on each
side of a comparison alike. Per measurement:

* ``raw_tcp_gb_per_s``: the arena's byte count sent by this process over one loopback TCP connection
  to a child process that receives it into a buffer of that size, allocated once connected (Python
  sendall and recv_into, no check): a plain copy of the same bytes into new memory, which a replica's
  arena also is; ``raw_tcp_touched_gb_per_s``: the same into a buffer allocated and touched
  beforehand, which no new replica has (its pages are what the plain copy pays for, a fault each);
* ``seed_gb_per_s``: the arena's bytes over the seconds the replica logs from dialling the source to
  the digests checked (header, stream, verification), with a source whose round window is 0;
* ``single_s``: one replica daemon from its spawn to READY (interpreter, imports, seeding, autotune
  from the source), against ``disk_s``: the same daemon with the shards and
  ``--weight-cache-seed-weights never``, which hashes and reads them (its autotune cache seeded too);
* ``fanout_s``: N replicas spawned at once, to the last READY, from a source whose round window is
  ``window_s`` and that expects ``round_replicas`` (N): the round starts once the N have asked, or at
  the window's end with those that did;
* ``single_cpu_s``, ``replica_cpu_s_N`` and ``source_round_cpu_s_N``: CPU seconds (user and system) a
  replica's process tree used from spawn to READY, and the fan-out source during its round; with
  ``fanout_N_cpu_floor_s`` (their sum over the host's cores) they say how much of a fan-out's time
  any schedule of the same work on this host would take;
* ``load_avg_1m``: the host's 1-minute load average before and after the run (other work competes
  for the same cores: the fan-out is CPU-bound here);
* ``source_bytes_sent_N``: what the source daemon's round sent (its log), against ``model_bytes``,
  the arena's size; each replica's own bytes sent are in ``replica_bytes_sent_N``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from wcache.bench.api import free_port
from wcache.bench.failure import bench_failure
from wcache.bench.processes import DaemonUnderTest, tree_cpu_s
from wcache.bench.settings import BenchSettings
from wcache.daemon.seed_settings import MAX_ROUND
from wcache.errors import UserError
from wcache.wire.sockets import short_private_dir

TOKEN_ENV = "WCACHE_SEED_TOKEN"
SEEDED = re.compile(r"weights: seeded from \S+ \(\d+ tensors, [\d.]+ MiB in ([\d.]+) s, ([^,]+), (\d+) bytes sent")
ROUND = re.compile(r"Seeding round \d+: (\d+) replica\(s\) of rank 0 served by (.*?) in ([\d.]+) s; (\d+) bytes sent "
                   r"by this daemon for (\d+) bytes of arena")
RECEIVER = """
import socket, sys, time
n, fresh = int(sys.argv[2]), sys.argv[3] == "fresh"
buf = None if fresh else bytearray(n)
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
buf = buf or bytearray(n)
view = memoryview(buf)
got = 0
while got < n:
    k = s.recv_into(view[got:], min(n - got, 4 << 20))
    if not k: sys.exit("closed early")
    got += k
print(time.monotonic())
"""


def raw_tcp_s(nbytes: int, fresh: bool = True) -> float:
    """Seconds to move ``nbytes`` from this process to a child over one loopback TCP connection;
    ``fresh``: into memory the child allocates once connected (as a replica's arena is), else into
    a buffer it allocated and touched before."""
    import socket

    data = bytearray(os.urandom(1 << 20)) * (-(-nbytes // (1 << 20)))
    with socket.create_server(("127.0.0.1", 0)) as server:
        child = subprocess.Popen([sys.executable, "-c", RECEIVER, str(server.getsockname()[1]), str(nbytes),
                                  "fresh" if fresh else "touched"],
                                 stdout=subprocess.PIPE, text=True)
        conn, _ = server.accept()
        t0 = time.monotonic()
        with conn:
            conn.sendall(memoryview(data)[:nbytes])
            out, _ = child.communicate(timeout=600)
    if child.returncode:
        raise bench_failure("the raw TCP copy", "receiver", out or "", code=child.returncode)
    return float(out.strip()) - t0


def small_files(model: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, dest / f.name)
    return dest


class Bench:
    def __init__(self, settings: BenchSettings, work: Path):
        self.settings, self.work = settings, work
        self.bare = small_files(Path(settings.model), work / "bare")
        self.n = 0

    def daemon(self, model, *extra: str, wait: bool = True, name: str = "replica") -> DaemonUnderTest:
        self.n += 1
        sockets = self.work / f"s{self.n}"
        sockets.mkdir(mode=0o700)
        # each daemon its own cache root: a replica on another host has no digest memo, no autotune file
        env = {"WCACHE_CACHE_ROOT": str(self.work / f"root{self.n}")}
        return DaemonUnderTest(str(model), self.settings.device, self.settings.dtype, sockets, extra=extra,
                               wait=wait, log_name=f"{name}-{self.n}.log", env=env)

    def source(self, window: float, expect: int | None = None) -> tuple[DaemonUnderTest, str]:
        address = f"127.0.0.1:{free_port()}"
        expected = ("--weight-cache-seed-round-replicas", str(expect)) if expect else ()
        return self.daemon(self.settings.model, "--weight-cache-seed-listen", address,
                           "--weight-cache-seed-round-window", str(window), *expected, name="source"), address

    def replicas(self, address: str, n: int) -> tuple[float, list[dict]]:
        t0 = time.monotonic()
        started = [self.daemon(self.bare, "--weight-cache-seed", address, wait=False) for _ in range(n)]
        try:
            for d in started:
                d.wait_ready(t0)
            took = time.monotonic() - t0
            return took, [{**_seeded(d), "cpu_s": tree_cpu_s(d.proc.pid)} for d in started]
        finally:
            for d in started:
                d.stop()


def _seeded(d: DaemonUnderTest) -> dict:
    m = SEEDED.search(d.text())
    if not m:
        raise bench_failure("a replica's seeding", "replica", d.text(), code=d.proc.returncode)
    return {"seconds": float(m.group(1)), "how": m.group(2), "bytes_sent": int(m.group(3))}


def _round(source: DaemonUnderTest, replicas: int) -> dict:
    found = [m for m in ROUND.finditer(source.text()) if int(m.group(1)) == replicas]
    if not found:
        raise bench_failure(f"a seeding round of {replicas}", "source daemon", source.text())
    m = found[-1]
    return {"how": m.group(2), "seconds": float(m.group(3)), "bytes_sent": int(m.group(4)), "arena": int(m.group(5))}


def _fanout(fans: list, fan: int, window: float, single_s: float, model_bytes: int, cores: int) -> dict:
    """The fan-out round's fields: the median (lower) of the repeats, against one replica and the model.
    ``fanout_N_cpu_floor_s``: the CPU seconds the N replicas' process trees used up to READY and the
    source's during the round, over the host's cores: the time the fan-out cannot beat on this host
    (every core busy all along), so what of ``fanout_N_s`` is the host's and what the design's."""
    fan_s, fan_rep, fan_round = sorted(fans, key=lambda f: f[0])[(len(fans) - 1) // 2]
    floor = (sum(r["cpu_s"] for r in fan_rep) + fan_round["cpu_s"]) / cores
    return {f"replica_cpu_s_{fan}": [round(r["cpu_s"], 2) for r in fan_rep],
            f"source_round_cpu_s_{fan}": round(fan_round["cpu_s"], 2),
            f"fanout_{fan}_cpu_floor_s": round(floor, 3), f"fanout_{fan}_cpu_floor_vs_single": round(floor / single_s, 3),
            "window_s": window, "round_replicas": fan, f"fanout_{fan}_s": round(fan_s, 3),
            f"fanout_{fan}_round_s": fan_round["seconds"], f"fanout_{fan}_how": fan_round["how"],
            f"source_bytes_sent_{fan}": fan_round["bytes_sent"],
            f"replica_bytes_sent_{fan}": [r["bytes_sent"] for r in fan_rep],
            f"fanout_{fan}_vs_single": round(fan_s / single_s, 3),
            f"source_bytes_sent_{fan}_vs_model": round(fan_round["bytes_sent"] / model_bytes, 4)}


def run_bench_seed(settings: BenchSettings) -> int:
    from wcache.bench.host import environment
    from wcache.core.config import EngineConfig

    if not 0 <= settings.seed_replicas <= MAX_ROUND:
        raise UserError(f"--seed-replicas must be from 0 to {MAX_ROUND} (0: no fan-out round), "
                        f"got {settings.seed_replicas}")
    cfg = EngineConfig.build(settings.model, settings.dtype, None, settings.device)
    work = short_private_dir("wcache-seed-")
    os.environ.setdefault(TOKEN_ENV, os.urandom(16).hex())  # every daemon of the run inherits it
    fan, window, repeat = settings.seed_replicas, settings.seed_window, max(1, settings.repeat)
    bench = Bench(settings, work)
    load_before = os.getloadavg()  # the host's other work: this bench is CPU-bound on a small host
    # Both sources up for the whole run, and every measurement once per repeat in turn: the host's
    # other work then weighs on the seed and its raw copy, on one replica and on the fan-out alike,
    # where measuring each kind in a block of its own let a change of load favour one side.
    src, address = bench.source(0.0)
    fan_src = None
    singles, single_cpu, seeds, rounds, disk, raw, touched, fans = [], [], [], [], [], [], [], []
    try:
        if fan:  # 0: no fan-out round (one GPU holds a source and one replica of a large model, not five)
            fan_src, fan_address = bench.source(window, fan)
        for _ in range(repeat):
            took, (one,) = bench.replicas(address, 1)
            singles.append(took)
            single_cpu.append(one["cpu_s"])
            seeds.append(one["seconds"])
            rounds.append(_round(src, 1))
            model_bytes = rounds[0]["arena"]
            raw.append(raw_tcp_s(model_bytes))
            touched.append(raw_tcp_s(model_bytes, fresh=False))
            # its autotune cache from the source as well: only the weights differ
            d = bench.daemon(settings.model, "--weight-cache-seed", address, "--weight-cache-seed-weights", "never",
                             name="disk")
            disk.append(d.ready_s)
            d.stop()
            if fan:
                src_cpu = tree_cpu_s(fan_src.proc.pid)
                took, replicas = bench.replicas(fan_address, fan)
                fans.append((took, replicas, {**_round(fan_src, fan), "cpu_s": tree_cpu_s(fan_src.proc.pid) - src_cpu}))
    finally:
        for s in (src, fan_src):
            if s is not None:
                s.stop()
        shutil.rmtree(work, ignore_errors=True)
    seed_s, raw_s = statistics.median(seeds), statistics.median(raw)
    single_s = statistics.median(singles)
    record = {**environment(cfg.device), "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              "model": Path(settings.model).name, "dtype": cfg.dtype_name, "repeat": repeat,
              "model_bytes": model_bytes,
              "seed_gb_per_s": round(model_bytes / seed_s / 1e9, 3), "raw_tcp_gb_per_s": round(model_bytes / raw_s / 1e9, 3),
              "raw_tcp_touched_gb_per_s": round(model_bytes / statistics.median(touched) / 1e9, 3),
              "seed_s": round(seed_s, 4), "raw_tcp_s": round(raw_s, 4), "single_source_round_s": rounds[0]["seconds"],
              "single_s": round(single_s, 3), "single_cpu_s": round(statistics.median(single_cpu), 2),
              "disk_s": round(statistics.median(disk), 3),
              "samples": {"seed_s": seeds, "raw_tcp_s": [round(r, 4) for r in raw],
                          "raw_tcp_touched_s": [round(r, 4) for r in touched], "single_s": [round(s, 3) for s in singles],
                          "disk_s": [round(s, 3) for s in disk]}}
    record["seed_vs_raw_tcp"] = round(record["seed_gb_per_s"] / record["raw_tcp_gb_per_s"], 3)
    record["single_vs_disk"] = round(single_s / record["disk_s"], 3)
    if fan:
        record.update(_fanout(fans, fan, window, single_s, model_bytes, os.cpu_count() or 1))
        record["samples"].update({f"fanout_{fan}_s": [round(f[0], 3) for f in fans],
                                  f"fanout_{fan}_round_s": [f[2]["seconds"] for f in fans],
                                  f"source_bytes_sent_{fan}": [f[2]["bytes_sent"] for f in fans]})
    text = json.dumps(record, indent=2)
    if settings.output:
        Path(settings.output).write_text(text + "\n")
    print(text)
    return 0
