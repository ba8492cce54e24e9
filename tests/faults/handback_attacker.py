"""A hostile engine, as its own process of the daemon's user, that reaches the socket directory only.

    python handback_attacker.py SOCKET KEY_JSON

It asks the daemon for the weights like any zero_copy engine (get_state), keeps the genuine arena's
descriptor and the daemon's description of it, and prints ``HELD <arena id>``. Each line it then
reads on stdin is a JSON object of fields to forge (``key``, ``manifest``, ``aliases``, ``attrs``,
``arena``): it plants a hand-back offer in the socket directory that hands the genuine descriptor
with the daemon's description, those fields replaced, to any daemon that asks, and prints
``OFFERED <path>``. It runs until stdin closes.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
from pathlib import Path

from wcache.wire.handback import OFFER_PREFIX
from wcache.wire.protocol import recv_frame, reply, request, send_frame


def hold(sock_path: Path, key: dict):
    lease = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lease.connect(str(sock_path))
    send_frame(lease, request("get_state", key=key, mode="zero_copy"))
    state, fds = recv_frame(lease, timeout=30)
    assert state.get("ok") and len(fds) == 1, state
    return lease, state, fds[0]


def offer(directory: Path, answer: dict, fd: int) -> Path:
    path = directory / f"{OFFER_PREFIX}{secrets.token_hex(8)}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(8)

    def serve():
        while True:
            conn, _ = listener.accept()
            with conn:
                try:
                    recv_frame(conn, timeout=10)
                    send_frame(conn, answer, [fd])
                except (OSError, EOFError):
                    pass

    threading.Thread(target=serve, daemon=True).start()
    return path


def main() -> int:
    sock_path, key = Path(sys.argv[1]), json.loads(sys.argv[2])
    lease, state, fd = hold(sock_path, key)
    print("HELD", state["arena"]["id"], flush=True)
    described = {k: state.get(k) for k in ("arena", "manifest", "aliases", "attrs", "device_id")}
    for line in sys.stdin:
        forged = json.loads(line)
        answer = reply(True, socket=sock_path.name, **{"key": key, **described, **forged})
        print("OFFERED", offer(sock_path.parent, answer, fd), flush=True)
    lease.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
