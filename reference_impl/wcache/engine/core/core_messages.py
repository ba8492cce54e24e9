"""What `wcache serve`'s front process and its engine core say to each other, and how it travels.

The two processes (engine/api_server/core_client.py, engine/core/core_proc.py) share one Unix socket pair, made by
the front and inherited by the core: no path on disk, so no other process can connect. Each message
is one frame: a 4-byte big-endian length, then the message as msgpack (vLLM V1's API server and
EngineCore also send msgpack). msgspec decodes it against the union below: a tagged Struct whose
unknown fields, wrong types or missing fields are refused, never an object of a class the bytes
name (no pickle). A frame over ``MAX_FRAME_BYTES`` or one that does not decode is a ``ChannelError``.

Front to core: ``Start`` (the flags), ``Proceed``, ``AddRequest``, ``AbortRequest``, ``Shutdown``. Core to front: ``Planned`` (whether
this node serves HTTP), ``Ready`` (what the HTTP layer reads of the engine), ``StepOutputs`` (once per
step: every request's new tokens, and its end), ``QueueFullError``, ``Status`` (the gauges) and
``Unhealthy`` (a rank died).
Records grow optional fields with defaults (a token's logprobs, say) without breaking either end.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
import typing
from typing import Any

import msgspec

from wcache.engine.worker.outputs import PromptScores, Sampled
from wcache.engine.worker.sampling_params import SamplingParams
from wcache.errors import FRAME_MALFORMED, FRAME_TOO_BIG

MAX_FRAME_BYTES = 16 << 20  # a prompt of max_model_len token ids is far less
_HEADER = struct.Struct(">I")


class ChannelError(Exception):
    """The other end sent something that is not a message: a bug, or a process that is not ours."""


class _Msg(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    pass


def _struct_of(cls, name: str) -> type[msgspec.Struct]:
    """A Struct with ``cls``'s dataclass fields, types and defaults: a field added to the dataclass
    (a penalty, logprobs) travels without a change here."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = msgspec.field(default_factory=f.default_factory)
        else:
            fields.append((f.name, hints[f.name]))
            continue
        fields.append((f.name, hints[f.name], default))
    return msgspec.defstruct(name, fields, module=__name__, forbid_unknown_fields=True)


Sampling = _struct_of(SamplingParams, "Sampling")  # SamplingParams on the channel


def sampling_of(params: SamplingParams) -> Sampling:
    return Sampling(**{f.name: getattr(params, f.name) for f in dataclasses.fields(params)})


def params_of(sampling: Sampling) -> SamplingParams:
    return SamplingParams(**msgspec.structs.asdict(sampling))


class Start(_Msg):
    """The front's first frame: the engine core's settings (settings.CoreSettings, as core/settings.py's
    to_data gives them; the core checks them again with from_data). The API key is not among them."""

    settings: dict[str, Any]


class Proceed(_Msg):
    """After Planned: the front holds its port (or serves no HTTP on this node); the core loads.
    A --respawn spare (``spare``) loads all but its KV cache, says Prepared and waits for Promote:
    two KV caches, each sized to the device's free memory, would not fit one GPU."""

    spare: bool = False


class Promote(_Msg):
    """To a Prepared spare whose serving core died: allocate the KV cache, then say Ready."""


class AddRequest(_Msg):
    id: int
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop_token_ids: list[int]  # the ids that end it (the checkpoint's, unless ignore_eos, and the request's)
    held_token_ids: list[int] = []  # the ids min_tokens holds back (every stop id, EOS included)
    # A request resumed after its core died (front_failover.py): the tokens it was already sent. The
    # core re-runs them in place of its picks (scheduler.Sequence.replay), counts them as output
    # (max_tokens, min_tokens, penalties, the seeded draw's position), sends none of them again and
    # does not score the prompt again.
    output_token_ids: list[int] = []


class AbortRequest(_Msg):
    id: int


class Shutdown(_Msg):
    pass


class Planned(_Msg):
    drives: bool  # this node holds engine rank 0: the front serves HTTP (else it only waits for the core)


class LoadInfo(msgspec.Struct, forbid_unknown_fields=True):
    """The LoadReport fields /metrics shows (engine/api_server/metrics.py load_labels)."""

    source: str
    seconds: float
    external_bytes: int = 0
    fallback_kind: str | None = None
    transport: str | None = None


class Prepared(_Msg):
    """A spare's word after Proceed(spare=True): weights loaded, warm-up run, no KV cache yet."""

    pid: int


class Ready(_Msg):
    pid: int
    max_model_len: int
    max_num_seqs: int
    has_draft: bool
    device: str
    vocab_size: int | None
    load_format: str
    report: LoadInfo


class Token(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One sampled token, with its log-probabilities when the request asked (completion.Sampled)."""

    id: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] = []


class PromptScored(msgspec.Struct, forbid_unknown_fields=True):
    """The prompt's tokens scored (completion.PromptScores): the first entry None."""

    ids: list[int]
    entries: list[Token | None]


def token_of(item: Sampled) -> Token:
    return Token(item.id, item.logprob, item.rank, list(item.top)) if item.logprob is not None else Token(item.id)


def sampled_of(t: Token) -> Sampled:
    return Sampled(t.id, t.logprob, t.rank, tuple(t.top))


def prompt_scored_of(p: PromptScores) -> PromptScored:
    return PromptScored(list(p.ids), [None if e is None else token_of(e) for e in p.entries])


def prompt_scores_of(p: PromptScored) -> PromptScores:
    return PromptScores(tuple(p.ids), tuple(None if e is None else sampled_of(e) for e in p.entries))


class RequestOutput(msgspec.Struct, forbid_unknown_fields=True):
    id: int
    tokens: list[Token] = []
    # Set on a request's last output: "eos", "length", "cancelled", "abort" (the engine stops),
    # "error" (the step loop failed, with ``error`` its text).
    finished: str | None = None
    error: str | None = None
    prompt_scores: PromptScored | None = None  # once, before the first token (echo, prompt_logprobs)


class StepOutputs(_Msg):
    outputs: list[RequestOutput]
    running: int = 0  # the scheduler's counts as the step ended (the /metrics gauges)
    waiting: int = 0


class QueueFullError(_Msg):
    id: int
    waiting: int
    limit: int


class Waiting(_Msg):
    """The core's loader waits for the weight cache daemon (engine/loading/waiting.py): the front's
    /health says so, as one process's does. ``state`` (socket, reason, timeout_s) None: it waits no more."""

    state: dict[str, Any] | None = None


class Unhealthy(_Msg):
    """An engine rank of this node died after start-up: /health answers 503 (engine/worker/supervisor.py)."""


class Status(_Msg):
    running: int
    waiting: int
    daemon_alive: float | None = None  # zero_copy only (engine/api_server/metrics.py)


ToCore = Start | Proceed | Promote | AddRequest | AbortRequest | Shutdown
ToFront = Planned | Prepared | Ready | Waiting | StepOutputs | QueueFullError | Status | Unhealthy


class Channel:
    """One end of the socket pair: ``send`` from any thread, ``recv`` from one; ``recv`` returns
    None at the other end's close (its process ended)."""

    def __init__(self, sock: socket.socket, incoming):
        self.sock = sock
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)
        self._send_lock = threading.Lock()

    def send(self, msg: _Msg) -> None:
        data = self._encoder.encode(msg)
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self):
        head = self._read(_HEADER.size)
        if head is None:
            return None
        (size,) = _HEADER.unpack(head)
        if size > MAX_FRAME_BYTES:
            raise ChannelError(FRAME_TOO_BIG.format(size=size, limit=MAX_FRAME_BYTES))
        body = self._read(size)
        if body is None:
            return None
        return decode(self._decoder, body)

    def _read(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except OSError:
                return None
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def decode(decoder: msgspec.msgpack.Decoder, body: bytes):
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ChannelError(FRAME_MALFORMED.format(error=e)) from None


def front_channel(sock: socket.socket) -> Channel:
    return Channel(sock, ToFront)


def core_channel(sock: socket.socket) -> Channel:
    return Channel(sock, ToCore)
