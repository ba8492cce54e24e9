"""A safetensors shard's header, checked against the file before any tensor of it is read.

A shard is 8 bytes of header length (little-endian), the JSON header, then the tensors' bytes at the
offsets the header gives. The safetensors library refuses a broken one with a ``SafetensorError``
that names no file (a traceback out of ``wcache serve``), or tries to allocate what a forged length
says. ``check_shard`` reads 8 bytes and the header, never the data, and says what is wrong and in
which file: an empty or truncated file, a length past the file or past safetensors' 100 MB cap, a
header that is not a JSON object of tensor entries, offsets that are not inside the data or do not
match the shape and dtype. The engine and the daemon check each shard (core/checkpoint.py), and so
does ``wcache-verify-checkpoint`` (examples/verify_checkpoint.py), with the same texts.

Standard library only: the image's checkpoint check imports it without torch.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from wcache.errors import UserError

MAX_HEADER = 100_000_000  # safetensors' own cap on the JSON header (its N_MAX_HEADER)
# Bytes per element of each safetensors dtype (its Dtype enum); the sub-byte ones are refused.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class BadShard(UserError):
    """A shard that is not a whole safetensors file: ``file`` and ``problem`` (str() joins them)."""

    def __init__(self, file: Path, problem: str):
        super().__init__(f"{file.name}: {problem}")
        self.file, self.problem = file, problem


def read_header(path: Path, size: int | None = None) -> tuple[int, dict]:
    """(header length, the parsed header); BadShard when they cannot be read."""
    size = path.stat().st_size if size is None else size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadShard(path, f"the file is {size} bytes: too short for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER or 8 + length > size:
            raise BadShard(path, f"header of {length} bytes does not fit in its {size} bytes")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as e:
            raise BadShard(path, f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise BadShard(path, f"header is a JSON {type(header).__name__}, not an object of tensors")
    return length, header


def _tensor_end(path: Path, name: str, entry) -> int:
    """Where tensor ``name``'s bytes end in the data; BadShard when its entry cannot be served."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise BadShard(path, f"tensor {name!r}: its entry is not {{dtype, shape, data_offsets}}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise BadShard(path, f"tensor {name!r}: dtype {dtype!r} is not one wcache reads")
    if not _sizes(shape) or not _sizes(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise BadShard(path, f"tensor {name!r}: shape {shape!r} and data_offsets {offsets!r} are not sizes")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise BadShard(path, f"tensor {name!r}: {end - begin} bytes for shape {shape} of {dtype}")
    return end


def _sizes(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def check_shard(path: Path) -> int:
    """The shard's tensor count; BadShard naming the file and the problem when it is not whole."""
    path = Path(path)
    if not path.is_file():
        raise BadShard(path, "the file is missing")
    size = path.stat().st_size
    length, header = read_header(path, size)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((_tensor_end(path, k, v) for k, v in tensors.items()), default=0)
    if 8 + length + end != size:  # short: truncated, or offsets past the end; long: bytes nobody reads
        raise BadShard(path, f"the file is {size} bytes; its header describes {8 + length + end} (truncated or "
                             "still being copied?)")
    return len(tensors)
