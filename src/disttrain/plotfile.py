"""Where a ``--plot`` goes (``disttrain bench``, ``disttrain jobs metrics``): checked before any
work, written whole, and the path printed is the path written.

A name without a suffix gets ``.png`` (matplotlib would add it anyway, and the message must
name the file that exists); a folder that does not exist is an error, not created on the way
(a typo would otherwise leave a tree of folders); an unwritable place is one line, before a
benchmark spends minutes measuring.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .atomic import atomic_path
from .errors import UsageError

INSTALL_HINT = "pip install 'disttrain[plot]'"
FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")  # what matplotlib's Agg writes without extras (jpg: Pillow)


def require_matplotlib() -> None:
    """Fail before any work, not after minutes of measuring."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from None


def plot_path(value: str | os.PathLike) -> Path:
    """The file ``--plot VALUE`` will write, checked: its folder exists and takes a new file."""
    path = Path(value)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    if path.suffix[1:].lower() not in FORMATS:
        raise UsageError(f"--plot {value}: {path.suffix} is not an image format written here; "
                         f"use one of {', '.join('.' + f for f in FORMATS)}")
    folder = path.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise UsageError(f"--plot {value}: the folder {folder} {what} (create it, or give another path)")
    if path.is_dir():
        raise UsageError(f"--plot {value}: is a folder; give a file name, e.g. {path / 'plot.png'}")
    try:  # the only sure test of "can a file be made here" (root passes access() on /proc)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise UsageError(f"--plot {value}: cannot write in {folder}: {err.strerror}") from None
    return path


def save(fig, path: Path) -> Path:
    """``fig`` to ``path`` (from :func:`plot_path`), whole or not at all."""
    try:
        with atomic_path(path) as temp:
            fig.savefig(temp, format=path.suffix[1:].lower())
    except OSError as err:
        raise UsageError(f"--plot {path}: cannot write it: {err.strerror or err}") from None
    return path
