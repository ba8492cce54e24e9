"""Many engines at once, in one process: N threads released together by a barrier, each running the
real loader (``wcache.engine.loading.ipc_cache.IpcCacheLoader``) against a live daemon, some in zero_copy mode and
some in copy mode. (N full `wcache serve` processes would each pay a torch import on a 2-core box.)

Run as ``python storm_clients.py MODEL SOCKET N COPY_EVERY``: every COPY_EVERY-th engine uses copy
mode. Prints one JSON line when every engine has its weights or its error, then holds the zero_copy
leases until stdin closes, then lets go of them and exits.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time

from wcache.core.config import EngineConfig
from wcache.errors import UserError
from wcache.core.fingerprint import cache_key
from wcache.engine.loading.config import LoaderConfig
from wcache.engine.loading.ipc_cache import IpcCacheLoader


def main() -> int:
    model, sock, n, copy_every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cfg = EngineConfig.build(model, "auto", None, "cpu")
    cache_key(cfg)  # the checkpoint digest once, so the threads race on the socket, not on hashing
    barrier = threading.Barrier(n)
    results: list[dict] = [{} for _ in range(n)]
    leases = []

    def engine(i: int) -> None:
        mode = "copy" if copy_every and i % copy_every == 0 else "zero_copy"
        lc = LoaderConfig(mode=mode, fallback=False, socket_path=sock, state_timeout_s=60.0)
        barrier.wait()
        t0 = time.monotonic()
        try:
            weights, report, lease = IpcCacheLoader(lc).load(cfg)
        except UserError as e:
            results[i] = {"mode": mode, "error": str(e)}
            return
        if lease is not None:
            leases.append(lease)
        first = next(iter(weights.tensors.values()))
        results[i] = {"mode": mode, "source": report.source, "tensors": report.tensors,
                      "checksum": float(first.float().sum()), "seconds": time.monotonic() - t0}

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served = [r for r in results if "source" in r]
    print(json.dumps({
        "served": len(served),
        "sources": dict(collections.Counter(r["source"] for r in served)),
        "errors": dict(collections.Counter(r["error"] for r in results if "error" in r)),
        "checksums": sorted({r["checksum"] for r in served}),
        "tensors": sorted({r["tensors"] for r in served}),
        "slowest_s": max((r["seconds"] for r in served), default=None),
        "wall_s": time.monotonic() - t0,
    }), flush=True)
    sys.stdin.read()  # hold the zero_copy leases until the test says so
    for lease in leases:
        lease.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
