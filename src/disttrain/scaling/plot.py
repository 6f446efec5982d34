"""The speed-up curve against the ideal line, as a PNG. Needs matplotlib (``disttrain[plot]``)."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from pathlib import Path

from ..plotfile import plot_path, require_matplotlib, save
from .report import Row

__all__ = ["require_matplotlib", "write_plot"]

FIGURE_INCHES = (6.4, 4.4)
TITLE_POINTS = 9
# Characters of a title line that fit the figure's width at TITLE_POINTS (about 0.6 em a character).
TITLE_CHARS = int(FIGURE_INCHES[0] * 72 / (TITLE_POINTS * 0.6)) - 4


def wrap_title(title: str) -> str:
    """``title`` in lines that fit the figure's width (one line ran off both sides)."""
    return "\n".join(textwrap.wrap(title, TITLE_CHARS))


def write_plot(path: str | os.PathLike[str], rows: Sequence[Row], *, title: str) -> Path:
    """Speed-up against processes, the ideal (linear) line dashed, noisy counts marked; written
    atomically to ``path`` (a name without a suffix gets ``.png``), which is returned."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    path = plot_path(path)
    done = [r for r in rows if r.speedup is not None]
    noisy = [r for r in done if r.noise]
    worlds = [r.world_size for r in rows]
    fig, ax = plt.subplots(figsize=FIGURE_INCHES, dpi=100)
    try:
        ax.plot(worlds, [r.ideal for r in rows], "--", color="grey", label="ideal (linear)")
        ax.plot([r.world_size for r in done], [r.speedup for r in done], "o-", label="measured (best run)")
        if noisy:
            ax.plot([r.world_size for r in noisy], [r.speedup for r in noisy], "o", markersize=12,
                    markerfacecolor="none", markeredgecolor="red", label="noise: not to be trusted")
        for r in done:
            ax.annotate(f"{r.efficiency:.0%} eff.{' (noise)' if r.noise else ''}", (r.world_size, r.speedup),
                        textcoords="offset points", xytext=(0, 9), ha="center", fontsize=8,
                        color="red" if r.noise else "black")
        for r in rows:
            if r.speedup is None:
                ax.axvline(r.world_size, color="red", alpha=0.3)
                ax.annotate("failed", (r.world_size, 0), textcoords="offset points", xytext=(-3, 3),
                            ha="right", color="red", fontsize=8)
        ax.set_xticks(worlds)
        ax.margins(x=0.15)  # room for the labels of the first and last points
        ax.set_xlabel("processes")
        ax.set_ylabel("speed-up (samples/s over the smallest count)")
        ax.set_ylim(bottom=0, top=max([*(r.ideal for r in rows), *(r.speedup for r in done)]) * 1.15)
        ax.set_title(wrap_title(title), fontsize=TITLE_POINTS)
        ax.grid(alpha=0.3)
        # Below the axes: inside, it covered the points' labels wherever it went.
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
        fig.tight_layout()
        return save(fig, path)
    finally:
        plt.close(fig)
