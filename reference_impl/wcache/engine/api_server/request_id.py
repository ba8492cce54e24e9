"""``X-Request-Id``: the client's, when it is one a log line and a response header can carry safely,
else a new one.

A valid id is 1 to 128 bytes of visible ASCII (``!`` to ``~``): no spaces, no control characters,
nothing a log reader or a proxy could misread (a CR or LF would split the header it is echoed in; a
space would split the access log's fields). A malformed id is replaced, never echoed, and the
replacement is a uuid4 in hex, as vLLM makes its request ids.
"""

from __future__ import annotations

import re
import uuid

HEADER = "X-Request-Id"
MAX_BYTES = 128
_VALID = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_BYTES)


def request_id(given: str | None) -> str:
    """The id this request is known by: ``given`` if valid, else a new uuid4 hex."""
    if given is not None and _VALID.fullmatch(given):
        return given
    return uuid.uuid4().hex
