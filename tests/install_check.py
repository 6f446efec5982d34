"""Is the venv what the README promises? The pinned CPU torch, no CUDA wheels beside it.

Run by the Makefile after every install step (so a bad resolve stops setup at once) and by
tests/test_install.py (so CI goes red if one slipped through). Prints one summary line.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

CONSTRAINTS = Path(__file__).resolve().parent.parent / "constraints.txt"
# Wheels that only come with a CUDA build of torch (nvidia-cublas-cu12, triton, ...).
CUDA_ONLY = re.compile(r"^(nvidia-.*|triton|pytorch-triton.*)$", re.IGNORECASE)


def pinned(name: str) -> str | None:
    for line in CONSTRAINTS.read_text().splitlines():
        m = re.match(rf"^\s*{re.escape(name)}\s*==\s*([^\s#]+)", line)
        if m:
            return m.group(1)
    return None


def problems() -> list[str]:
    found = []
    want = pinned("torch")
    try:
        have = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ["torch is not installed"]
    public, _, local = have.partition("+")
    if want and public != want:
        found.append(f"torch {have} is installed, constraints.txt pins {want}")
    if local and local != "cpu":
        found.append(f"torch {have} is not the CPU build")
    cuda = sorted({d.metadata["Name"] for d in metadata.distributions() if CUDA_ONLY.match(d.metadata["Name"] or "")})
    if cuda:
        found.append(f"CUDA-only packages are installed: {', '.join(cuda)}")
    return found


def venv_size_mb() -> int:
    root = Path(sys.prefix)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink()) // 2**20


def main() -> int:
    bad = problems()
    if bad:
        for line in bad:
            print(f"install check: {line}; rebuild with `make clean setup`", file=sys.stderr)
        return 1
    print(f"install check: torch {metadata.version('torch')}, no CUDA wheels, venv {venv_size_mb()} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
