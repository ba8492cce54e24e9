"""Print the requirements of one optional-dependency group of pyproject.toml, one a line.

`make docs` installs the `docs` group alone into a venv of its own (the site needs neither torch
nor the test tools): ``python tools/extra_requirements.py docs | xargs pip install``.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the TOML reader pip itself carries
    from pip._vendor import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def requirements(group: str) -> list[str]:
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"][group]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: extra_requirements.py GROUP")
    print("\n".join(requirements(sys.argv[1])))
