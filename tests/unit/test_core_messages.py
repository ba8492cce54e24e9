"""The front/engine-core channel's frames (engine/core/core_messages.py), over a real socket pair."""

from __future__ import annotations

import socket
import struct

import msgspec
import pytest
from wcache.engine.core.core_messages import (
    MAX_FRAME_BYTES,
    AbortRequest,
    AddRequest,
    ChannelError,
    Prepared,
    Proceed,
    Promote,
    RequestOutput,
    Sampling,
    StepOutputs,
    Token,
    core_channel,
    front_channel,
    params_of,
    sampling_of,
)
from wcache.engine.worker.sampling_params import SamplingParams


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    front, core = front_channel(a), core_channel(b)
    yield front, core
    front.close()
    core.close()


def test_messages_cross_as_they_were_sent(pair):
    front, core = pair
    params = SamplingParams(0.7, 0.9, 1234)
    front.send(AddRequest(7, [1, 2, 3], 16, sampling_of(params), [1]))
    front.send(AbortRequest(7))
    add = core.recv()
    assert add == AddRequest(7, [1, 2, 3], 16, Sampling(0.7, 0.9, 1234), [1])
    assert params_of(add.sampling) == params
    assert core.recv() == AbortRequest(7)
    out = StepOutputs([RequestOutput(7, [Token(5), Token(6)]), RequestOutput(8, [], "error", "boom")])
    core.send(out)
    assert front.recv() == out


def test_a_resumed_request_carries_the_tokens_already_sent(pair):
    front, core = pair
    first = AddRequest(7, [1, 2, 3], 16, sampling_of(SamplingParams()), [1])
    assert first.output_token_ids == []  # a fresh request's default, so older senders still decode
    front.send(msgspec.structs.replace(first, output_token_ids=[9, 8]))
    assert core.recv().output_token_ids == [9, 8]


def test_a_spare_is_told_so_says_prepared_and_waits_for_promote(pair):
    """front_failover.py's spare: Proceed(spare=True), Prepared back, then Promote (its KV cache)."""
    front, core = pair
    front.send(Proceed())
    front.send(Proceed(spare=True))
    front.send(Promote())
    assert [core.recv() for _ in range(3)] == [Proceed(spare=False), Proceed(spare=True), Promote()]
    core.send(Prepared(4242))
    assert front.recv() == Prepared(4242)
    core.send(Promote())  # a message of the other direction is refused, not taken
    with pytest.raises(ChannelError, match="malformed frame on the engine core channel"):
        front.recv()


def test_the_sampling_struct_is_built_from_sampling_params_fields():
    import dataclasses

    assert [f.name for f in dataclasses.fields(SamplingParams)] == list(Sampling.__struct_fields__)
    assert params_of(sampling_of(SamplingParams())) == SamplingParams()


def test_a_closed_end_reads_as_none(pair):
    front, core = pair
    front.close()
    assert core.recv() is None


def _raw(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(">I", len(payload)) + payload)


@pytest.mark.parametrize("payload, says", [
    (b"\xc1", "malformed frame on the engine core channel: "),  # not msgpack
    (msgspec.msgpack.encode({"type": "Pickle", "id": 1}), "Invalid value 'Pickle'"),  # no such message
    (msgspec.msgpack.encode({"type": "AbortRequest", "id": 1, "extra": 2}), "Object contains unknown field `extra`"),
    (msgspec.msgpack.encode({"type": "AbortRequest", "id": "1"}), "Expected `int`, got `str`"),
    (msgspec.msgpack.encode({"type": "AddRequest", "id": 1}), "missing required field"),
])
def test_a_malformed_frame_is_a_clear_error(pair, payload, says):
    front, core = pair
    _raw(front.sock, payload)
    with pytest.raises(ChannelError) as err:
        core.recv()
    assert str(err.value).startswith("malformed frame on the engine core channel: ")
    assert says in str(err.value)


def test_an_oversize_frame_is_refused_before_it_is_read(pair):
    front, core = pair
    front.sock.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))
    with pytest.raises(ChannelError) as err:
        core.recv()
    assert str(err.value) == (f"frame of {MAX_FRAME_BYTES + 1} bytes on the engine core channel; "
                              f"the limit is {MAX_FRAME_BYTES}")
