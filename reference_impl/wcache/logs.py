"""One log format for every wcache process, so the guide's expected lines match all of them."""

import logging
import sys

FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def setup(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
