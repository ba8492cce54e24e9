"""Concurrent streaming clients against a real ``wcache serve``: is every stream complete, is none
refused, and how long does each wait for its first token?

``python -m wcache.bench.streaming MODEL_DIR --clients 16 --output FILE`` starts ``wcache serve`` on a
free loopback port, asks once for the plain greedy completion, then starts ``--clients`` streaming
requests at the same instant (one thread and connection each, raw HTTP so nothing but the socket
sits between the clock and the bytes) and checks that every stream ends with ``data: [DONE]`` and
that its pieces join to the plain completion. The record (JSON) carries the date, the machine and
torch; docs/benchmarks.md's streaming table is generated from the records in docs/benchmarks/
(tools/doc_tables.py).

The engine batches the clients (continuous batching): each joins at the next step. With
``--vs-one`` the same run first times a lone client on the idle engine and prints the clients'
aggregate tokens/s and time-to-first-token p99 as multiples of its, with the engine's own per-step
figures (logged when it stops): the step, the forward passes in it, and the overhead between.

Every run also records what a step is made of (``step_profile``, engine/core/step_clock.py: per step the
device's time from CUDA events, the device idle between steps, host time, the engine thread's CPU
time, rows, and the host time by phase), for the clients' burst and the lone client's last run,
printed as a table; and, once the server is gone, the same model's bare decode step with no server
(``bare_step``, bench/bare_step.py: a CUDA graph of one plain pass at 1 and 64 rows, KV length 512;
eager on CPU), the rate each step is measured against (``vs_bare``: the decode tokens/s as a share
of it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from wcache.bench.api import free_port, healthy

RECORD_KEY = "streaming_clients"
PROMPT = "Hello"
KEYS = {"date", "host", "python", "torch", "wcache", "device", "cpu_count", "machine", "model", RECORD_KEY,
        "max_tokens", "completed", "refused", "matching_text", "ttft_s", "request_s", "wall_s"}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of 16 values is the largest)."""
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def start_engine(model: str, port: int, log_path: Path, device: str = "cpu",
                 dtype: str | None = None) -> subprocess.Popen:
    log = log_path.open("wb")
    # How the weights arrive (disk or ipc_cache) does not change a decode step, so the engine reads them.
    proc = subprocess.Popen([sys.executable, "-m", "wcache.cli", "serve", model, "--device", device, "--host",
                             "127.0.0.1", "--port", str(port), "--no-enable-autotune", "--shutdown-delay", "0",
                             *(["--dtype", dtype] if dtype else [])],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"wcache serve exited with {proc.returncode}:\n{log_path.read_text()[-2000:]}")
        if healthy(port):
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"wcache serve not healthy within 180 s:\n{log_path.read_text()[-2000:]}")


def plain_text(port: int, max_tokens: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": max_tokens}),
                 {"Content-Type": "application/json"})
    return json.loads(conn.getresponse().read())["choices"][0]["text"]


def stream_once(port: int, max_tokens: int, go: threading.Barrier) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}})
    # Connected before the clock starts, as a client with a connection pool (the official OpenAI
    # client's) is: 16 threads of one Python process that each connected after the barrier reached
    # the server over some 20 ms on a 2-core host, a cost of the load generator, not of the engine.
    conn.connect()
    go.wait()
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        return {"status": r.status, "done": False}
    ttft, pieces, done, finish, tokens = None, [], False, None, 0
    for line in r:  # http.client undoes the chunked transfer encoding
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            done = True
            break
        event = json.loads(data)
        choices = event["choices"]
        if not choices:  # the usage chunk
            tokens = event["usage"]["completion_tokens"]
        else:
            if choices[0]["text"] and ttft is None:
                ttft = time.perf_counter() - t0
            pieces.append(choices[0]["text"])
            finish = choices[0]["finish_reason"] or finish
    conn.close()
    return {"status": 200, "done": done and finish is not None, "ttft_s": ttft, "t0": t0,
            "request_s": time.perf_counter() - t0, "text": "".join(pieces), "tokens": tokens}


def one_client(port: int, max_tokens: int, rounds: int = 3) -> dict:
    """A lone streaming client, ``rounds`` times on the idle engine: its median time to first token
    and tokens per second (the baseline of the ratios)."""
    runs = [stream_once(port, max_tokens, threading.Barrier(1)) for _ in range(rounds)]
    runs = [r for r in runs if r.get("done")]
    if not runs:
        return {}
    return {"ttft_s": round(statistics.median(r["ttft_s"] for r in runs), 4),
            "tokens_per_s": round(statistics.median(r["tokens"] / r["request_s"] for r in runs), 2),
            "decode_tokens_per_s": round(statistics.median(decode_rate([r]) for r in runs), 2)}


def decode_rate(streams: list[dict]) -> float:
    """Tokens after the first, per second of the window from the earliest first token to the last
    stream's end: the decode steps' throughput, without the prompts' passes before it."""
    start = min(r["t0"] + r["ttft_s"] for r in streams)
    end = max(r["t0"] + r["request_s"] for r in streams)
    return sum(r["tokens"] - 1 for r in streams) / (end - start)


def engine_steps(log_path: Path, marker: str = "Engine steps (ms per step): ") -> dict | None:
    """The engine's own per-step figures, logged when it stops (engine.STEP_STATS)."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if marker in line]
    return json.loads(lines[-1].split(marker, 1)[1]) if lines else None


def step_profile(log_path: Path, vs_one: bool) -> dict | None:
    """What a step costs and where its time goes (engine/core/step_clock.py), for the clients' burst and,
    with ``--vs-one``, the lone client's last run: the engine's last two busy periods (it goes idle
    between the bench's requests, and the burst's streams all end in its last one)."""
    logged = engine_steps(log_path, "Engine step profile: ")
    if not logged or not logged["busy_periods"]:
        return None
    periods = logged["busy_periods"]
    out = {"clients": periods[-1]}
    if vs_one and len(periods) > 1:
        out["one_client"] = periods[-2]
    if "gpu_null_because" in logged:
        out["gpu_null_because"] = logged["gpu_null_because"]
    return out


STEP_COLUMNS = (("steps", "steps"), ("rows", "rows"), ("graph_rows", "graph rows"), ("step_ms", "step ms"),
                ("gpu_ms", "GPU ms"), ("gpu_idle_ms", "GPU idle"), ("host_ms", "host ms"), ("cpu_ms", "CPU ms"))


def step_table(record: dict) -> str:
    """The bench's table of a step: per phase of the run (all steps, then decode-only steps), the
    step's figures and the host time's profile, in ms per step; then the bare step's rate."""
    prof = record.get("step_profile") or {}
    rows = []
    for who in ("one_client", "clients"):
        for kind, p in (("all", prof.get(who)), ("decode", (prof.get(who) or {}).get("decode_steps"))):
            if not p:
                continue
            cells = ["-" if p[k] is None else f"{p[k]:g}" for k, _ in STEP_COLUMNS]
            where = " ".join(f"{k[:-3]} {v:g}" for k, v in p["profile"].items())
            rows.append(f"{who:>10} {kind:>6} | " + " | ".join(f"{c:>10}" for c in cells) + f" | {where}")
    head = f"{'run':>10} {'steps':>6} | " + " | ".join(f"{h:>10}" for _, h in STEP_COLUMNS) + " | host profile (ms)"
    lines = [head, *rows]
    if prof.get("gpu_null_because"):
        lines.append(f"GPU columns null: {prof['gpu_null_because']}")
    bare = record.get("bare_step")
    if bare:
        share = record.get("vs_bare")
        lines.append(f"bare step ({bare['mode']}): 1 row {bare['tokens_per_s_1']} tokens/s, "
                     f"64 rows {bare['tokens_per_s_64']} tokens/s" + (
                         f"; decode tokens/s as a share of it: one client {share['one_client']}, "
                         f"clients {share['clients']}" if share else "")
                     if bare.get("tokens_per_s_1") is not None else f"bare step: null ({bare.get('null_because')})")
    return "\n".join(lines)


BARE_STEP_TIMEOUT_S = 240  # a llama-8b read again from the page cache, and two graphs


def bare_step(model: str, device: str, dtype: str | None) -> dict:
    """The same model's bare decode step (bench/bare_step.py), in a process of its own once the
    server is gone; its figures null, with the reason, where it failed."""
    cmd = [sys.executable, "-m", "wcache.bench.bare_step", model, "--device", device,
           *(["--dtype", dtype] if dtype else [])]
    null = {"tokens_per_s_1": None, "tokens_per_s_64": None}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=BARE_STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {**null, "null_because": f"timed out after {BARE_STEP_TIMEOUT_S} s"}
    if done.returncode != 0 or not done.stdout.strip():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {**null, "null_because": f"exited with {done.returncode}: {last}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratios(record: dict) -> dict | None:
    """N clients against one, measured in the same run: aggregate decode tokens/s and time to
    first token p99, each as a multiple of the lone client's."""
    one = record.get("one_client")
    if not one or not record["ttft_s"]:
        return None
    return {"tokens_per_s": round(record["tokens_per_s"] / one["tokens_per_s"], 2),
            "decode_tokens_per_s": round(record["decode_tokens_per_s"] / one["decode_tokens_per_s"], 2),
            "ttft_p99": round(record["ttft_s"]["p99"] / one["ttft_s"], 2)}


def run(model: str, clients: int, max_tokens: int, workdir: Path, vs_one: bool = False, device: str = "cpu",
        dtype: str | None = None) -> dict:
    from wcache.bench.host import environment
    from wcache.core.autotune import cpu_name

    port = free_port()
    proc = start_engine(model, port, workdir / "engine.log", device, dtype)
    try:
        want = plain_text(port, max_tokens)
        one = one_client(port, max_tokens) if vs_one else None
        go = threading.Barrier(clients)
        results: list[dict] = [{} for _ in range(clients)]

        def client(i: int) -> None:
            try:
                results[i] = stream_once(port, max_tokens, go)
            except OSError as e:
                results[i] = {"status": None, "done": False, "error": str(e)}

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()  # its device memory is free before the bare step's process takes some
    complete = [r for r in results if r.get("done")]
    bare = bare_step(model, device, dtype)
    extra = {}
    if vs_one:
        extra = {"one_client": one, "tokens_per_s": round(sum(r["tokens"] for r in complete) / wall, 2),
                 "decode_tokens_per_s": round(decode_rate(complete), 2),
                 "engine_steps": engine_steps(workdir / "engine.log")}
    extra["step_profile"] = step_profile(workdir / "engine.log", vs_one)
    extra["bare_step"] = bare
    if vs_one and one and bare.get("tokens_per_s_1"):  # the share of the bare step's rate each reached
        extra["vs_bare"] = {"one_client": round(one["decode_tokens_per_s"] / bare["tokens_per_s_1"], 3),
                            "clients": round(extra["decode_tokens_per_s"] / bare["tokens_per_s_64"], 3)}
    ttfts = [r["ttft_s"] for r in complete if r["ttft_s"] is not None]
    requests = [r["request_s"] for r in complete]
    return {
        **environment(device), "machine": platform.machine(), "cpu_model": cpu_name(), "model": Path(model).name, RECORD_KEY: clients,
        "max_tokens": max_tokens, "completed": len(complete), "refused": sum(1 for r in results if r.get("status") != 200),
        "matching_text": sum(1 for r in complete if r["text"] == want),
        "ttft_s": {"p50": round(statistics.median(ttfts), 4), "p99": round(percentile(ttfts, 99), 4),
                   "min": round(min(ttfts), 4)} if ttfts else None,
        "request_s": {"p50": round(statistics.median(requests), 4), "p99": round(percentile(requests, 99), 4)}
        if requests else None,
        "wall_s": round(wall, 3), **extra,
    }


def problems(record: dict) -> list[str]:
    """What makes a record unfit to publish (empty when fit)."""
    out = [f"missing key {k!r}" for k in sorted(KEYS - set(record))]
    if out:
        return out
    n = record[RECORD_KEY]
    if record["completed"] != n or record["matching_text"] != n:
        out.append(f"{record['completed']} of {n} streams complete, {record['matching_text']} matching the plain text")
    if record["refused"]:
        out.append(f"{record['refused']} of {n} requests refused")
    t = record["ttft_s"]
    if not t or not 0 < t["min"] <= t["p50"] <= t["p99"] <= record["wall_s"]:
        out.append(f"time-to-first-token figures out of order: {t}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wcache.bench.streaming", description=__doc__.splitlines()[0])
    p.add_argument("model", help="checkpoint directory (e.g. one `wcache make-checkpoint --preset tiny` wrote)")
    p.add_argument("--clients", type=int, default=16, help="streaming clients started at once (default 16)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each asks for (default 32)")
    p.add_argument("--output", type=Path, help="also write the record (JSON) here")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the engine's device (default cpu)")
    p.add_argument("--dtype", help="the engine's --dtype (default: wcache serve's)")
    p.add_argument("--vs-one", action="store_true",
                   help="first time a lone client on the idle engine, then print the clients' aggregate "
                        "tokens/s and time-to-first-token p99 as multiples of its, and the engine's per-step "
                        "overhead (step time minus forward time)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="wcache-bench-http-") as workdir:
        record = run(args.model, args.clients, args.max_tokens, Path(workdir), args.vs_one, args.device, args.dtype)
    if args.vs_one:
        record["vs_one"] = ratios(record)
    text = json.dumps(record, indent=2) + "\n"
    if args.output:
        args.output.write_text(text)
    print(text, end="")
    if args.vs_one and record["vs_one"]:
        r, steps = record["vs_one"], record.get("engine_steps") or {}
        one = record["one_client"]
        print(f"{args.clients} clients vs one: aggregate tokens/s x{r['tokens_per_s']} (decode tokens/s "
              f"{record['decode_tokens_per_s']} vs {one['decode_tokens_per_s']}: x{r['decode_tokens_per_s']}), "
              f"time to first token p99 x{r['ttft_p99']}; engine step {steps.get('step_ms')} ms = forward {steps.get('forward_ms')} ms "
              f"+ overhead {steps.get('overhead_ms')} ms", file=sys.stderr)
    print(step_table(record), file=sys.stderr)
    bad = problems(record)
    for b in bad:
        print(f"unfit record: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
