"""Print ``name==floor`` for every dependency of pyproject.toml (and its ``test`` extra): the oldest versions the
project declares it supports, for ``make test-floor`` (the direct dependencies at their floors, pip choosing the
rest, as uv's ``--resolution lowest-direct`` does).

    python3 scripts/floor_pins.py > floor.txt && pip install -r floor.txt
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def requirements(text: str, extras=("test",)) -> list:
    """The dependency strings of ``[project] dependencies`` and the named optional extras (no TOML parser needed:
    it runs on any Python 3, before anything is installed)."""
    blocks = [re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)]
    blocks += [m.group(1) for e in extras for m in re.finditer(rf"^{e} = \[(.*?)\]", text, re.S | re.M)]
    return [s for b in blocks for s in re.findall(r'"([^"]+)"', b)]


def floor_pins(text: str) -> list:
    pins = []
    for req in requirements(text):
        match = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)\s*>=\s*([0-9][^,;\s]*)\s*(?:,[^;]*)?(;.*)?", req.strip())
        if not match:
            raise SystemExit(f"error: {req!r} in pyproject.toml has no '>=' floor")
        name, version, marker = match.groups()
        pins.append(f"{name}=={version}{marker or ''}")
    return pins


if __name__ == "__main__":
    print("\n".join(floor_pins((ROOT / "pyproject.toml").read_text())))
    sys.exit(0)
