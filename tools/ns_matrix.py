"""Which namespace and user combinations let an engine map a daemon's GPU weights?

Runs `wcache preload` and `wcache serve --load-format ipc_cache` (fallback off, so a failure is an
error and not a silent disk load) as sibling "containers" made with `unshare`, on any GPU host, as
root. Prints a Markdown table and writes JSON (`--json PATH`) with the exact error of each failing
combination. This is the measured basis of the guide's `--pid` / `--ipc` requirements.

    python tools/ns_matrix.py --model DIR [--transport cuda_ipc] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from wcache.bench.api import healthy

# A "container": own PID namespace (with its own /proc), own IPC namespace, own mount namespace
# with a private /dev/shm.
CONTAINER = "unshare --pid --fork --kill-child --mount-proc --ipc --mount bash -c 'mount -t tmpfs tmpfs /dev/shm && exec \"$0\" \"$@\"'"
PID_ONLY = "unshare --pid --fork --kill-child --mount-proc"
SHM_PRIVATE = "unshare --ipc --mount bash -c 'mount -t tmpfs tmpfs /dev/shm && exec \"$0\" \"$@\"'"
NON_ROOT = "setpriv --reuid=1000 --regid=1000 --clear-groups"
NO_PTRACE = "setpriv --bounding-set=-sys_ptrace --inh-caps=-sys_ptrace"

CASES = [
    # name, daemon wrapper, engine wrapper
    ("same host namespaces (docker --pid=host --ipc=host)", "", ""),
    ("sibling containers: own PID+IPC+mount ns, private /dev/shm", CONTAINER, CONTAINER),
    ("shared PID ns only (private IPC ns and /dev/shm each)", SHM_PRIVATE, SHM_PRIVATE),
    ("shared IPC ns and /dev/shm only (sibling PID ns)", PID_ONLY, PID_ONLY),
    ("engine in a child PID ns of the daemon's (--pid=container:daemon analogue)", "", PID_ONLY),
    ("daemon and engine both uid 1000 (non-root, same user)", NON_ROOT, NON_ROOT),
    ("engine without CAP_SYS_PTRACE (docker's default)", "", NO_PTRACE),
    ("daemon root, engine uid 1000 (different users)", "", NON_ROOT),
]


def run_case(name, d_wrap, e_wrap, args, work: Path, port: int) -> dict:
    sock_dir = work / "sockets"
    if sock_dir.exists():
        shutil.rmtree(sock_dir)
    sock_dir.mkdir(mode=0o700)
    if "1000" in d_wrap or "1000" in e_wrap:
        # The socket directory must be reachable by the other user for the case to reach CUDA at
        # all; the daemon's SO_PEERCRED check then decides.
        os.chmod(work, 0o755)
        os.chmod(sock_dir, 0o777 if d_wrap != e_wrap else 0o700)
        if d_wrap == e_wrap:
            os.chown(sock_dir, 1000, 1000)
    cache = work / f"cache-{abs(hash(name))}"  # fresh per case, owned by the daemon's user
    cache.mkdir()
    if d_wrap == NON_ROOT:
        os.chown(cache, 1000, 1000)
    env = {**os.environ, "WCACHE_CACHE_ROOT": str(cache), "PYTHONUNBUFFERED": "1"}
    py = sys.executable
    daemon_cmd = f"{d_wrap} {py} -m wcache.cli preload --model {args.model} --device cuda " \
                 f"--weight-cache-socket-dir {sock_dir} --weight-cache-transport {args.transport}"
    loader = json.dumps({"fallback": False, "socket_dir": str(sock_dir), "state_timeout_s": 30,
                         "transport": args.transport})
    engine_cmd = f"{e_wrap} {py} -m wcache.cli serve {args.model} --device cuda --host 127.0.0.1 --port {port} " \
                 f"--load-format ipc_cache --model-loader-extra-config '{loader}'"
    dlog, elog = work / "daemon.log", work / "engine.log"
    daemon = subprocess.Popen(daemon_cmd, shell=True, env=env, stdout=dlog.open("wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    result = {"case": name, "daemon": d_wrap or "host", "engine": e_wrap or "host"}
    try:
        deadline = time.monotonic() + 300
        while "Weight cache daemon READY" not in dlog.read_text(errors="replace"):
            if daemon.poll() is not None or time.monotonic() > deadline:
                result.update(maps=False, error="daemon failed: " + dlog.read_text(errors="replace")[-400:])
                return result
            time.sleep(0.2)
        engine = subprocess.Popen(engine_cmd, shell=True, env=env, stdout=elog.open("wb"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not healthy(port) and engine.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            text = elog.read_text(errors="replace")
            mapped = re.search(r"Mapped \d+ tensors from the weight cache daemon \(\w+ mode\)", text)
            if mapped and healthy(port):
                body = json.dumps({"prompt": "namespace", "max_tokens": 4}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body)
                with urllib.request.urlopen(req, timeout=60) as r:
                    ok = r.status == 200
                result.update(maps=ok, detail=mapped.group(0))
            else:
                errors = [ln for ln in text.splitlines() if "ERROR" in ln or "Error" in ln]
                result.update(maps=False, error=(errors[-1] if errors else text[-400:]).strip())
                dtext = dlog.read_text(errors="replace")
                rejected = [ln for ln in dtext.splitlines() if "Rejecting" in ln]
                if rejected:
                    result["daemon_log"] = rejected[-1].strip()
        finally:
            _kill(engine, signal.SIGKILL)
    finally:
        _kill(daemon, signal.SIGTERM)
    return result


def _kill(proc: subprocess.Popen, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
        proc.wait(30)
    except ProcessLookupError:
        proc.wait()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--transport", default="cuda_ipc", choices=["cuda_ipc", "vmm_fd"])
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--only", default=None, help="run only the cases whose name contains this text")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("ns_matrix: run as root (unshare and setpriv need it)")
    work = Path(tempfile.mkdtemp(prefix="wcache-ns-"))
    os.chmod(work, 0o755)
    rows = []
    for name, d, e in CASES:
        if args.only and args.only not in name:
            continue
        r = run_case(name, d, e, args, work, args.port)
        rows.append(r)
        print(json.dumps(r), flush=True)
    import torch

    meta = {"transport": args.transport, "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        meta["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    print(f"\nwcache namespace matrix, {meta}\n")
    print("| daemon / engine | maps? | what the engine logged |")
    print("| --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {'yes' if r['maps'] else 'no'} | {r.get('detail') or r.get('error', '')} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
