"""The speed-up curve against the ideal line, as a PNG. Needs matplotlib (``disttrain[plot]``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..atomic import atomic_path
from ..errors import UsageError
from .report import Row

INSTALL_HINT = "pip install 'disttrain[plot]'"


def require_matplotlib() -> None:
    """Fail before any count runs, not after minutes of measuring."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from None


def write_plot(path: str | os.PathLike[str], rows: Sequence[Row], *, title: str) -> Path:
    """Speed-up against processes, the ideal (linear) line dashed; written atomically."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.speedup is not None]
    worlds = [r.world_size for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    try:
        ax.plot(worlds, [r.ideal for r in rows], "--", color="grey", label="ideal (linear)")
        ax.plot([r.world_size for r in done], [r.speedup for r in done], "o-", label="measured")
        for r in done:
            ax.annotate(f"{r.efficiency:.0%} eff.", (r.world_size, r.speedup),
                        textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
        for r in rows:
            if r.speedup is None:
                ax.axvline(r.world_size, color="red", alpha=0.3)
                ax.annotate("failed", (r.world_size, 0), color="red", fontsize=8)
        ax.set_xticks(worlds)
        ax.set_xlabel("processes")
        ax.set_ylabel("speed-up (samples/s over the smallest count)")
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = Path(path)
        with atomic_path(path) as temp:
            fig.savefig(temp, format="png")
    finally:
        plt.close(fig)
    return path
