"""The run page's three small drawings as inline SVG: steps/s per rank, the membership timeline, the
goodput bar. Inline SVG needs no script library and no network (the page must work where there is
no internet); every text put into it is escaped (markupsafe, Jinja2's own)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from markupsafe import Markup, escape

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
GOODPUT_COLOURS = {"training": "#2ca02c", "startup": "#7f7f7f", "rendezvous": "#1f77b4", "checkpoint": "#9467bd",
                   "redone": "#ff7f0e", "hang": "#d62728", "stragglers": "#bcbd22"}
CHANGE_COLOURS = {"start": "#2ca02c", "left": "#d62728", "joined": "#1f77b4"}


def _num(x: float) -> str:
    return f"{x:.1f}"


def rates_plot(rates: Mapping[int, Sequence[tuple[float, float]]], means: Mapping[int, float] | None = None, *,
               width: int = 560, height: int = 160) -> Markup:
    """One line per rank: steps/s over time (seconds since the first point); where no series is known
    (a finished run, not tracked), each rank's mean as a bar."""
    series = {rank: list(points) for rank, points in rates.items() if points}
    if not series and means:
        return mean_bars(means, width=width)
    if not series:
        return Markup('<p class="none">no steps/s yet: the ranks report steps through disttrain\'s heartbeat '
                      '(a prepared loader, <code>disttrain.log</code>) or <code>--track-ranks</code></p>')
    t0 = min(t for pts in series.values() for t, _ in pts)
    t1 = max(t for pts in series.values() for t, _ in pts)
    top = max(v for pts in series.values() for _, v in pts) * 1.15 or 1.0
    left, bottom, right, up = 44, 22, 8, 8
    w, h = width - left - right, height - bottom - up

    def x(t: float) -> float:
        return left + (w * (t - t0) / (t1 - t0) if t1 > t0 else w / 2)

    def y(v: float) -> float:
        return up + h - h * v / top

    parts = [f'<svg class="chart" role="img" aria-label="steps per second per rank" width="{width}" '
             f'height="{height}" viewBox="0 0 {width} {height}">',
             f'<line x1="{left}" y1="{up + h}" x2="{left + w}" y2="{up + h}" stroke="#888"/>',
             f'<line x1="{left}" y1="{up}" x2="{left}" y2="{up + h}" stroke="#888"/>',
             f'<text x="{left - 4}" y="{up + 10}" text-anchor="end" class="axis">{top:.3g}</text>',
             f'<text x="{left - 4}" y="{up + h}" text-anchor="end" class="axis">0</text>',
             f'<text x="{left + w}" y="{height - 4}" text-anchor="end" class="axis">{t1 - t0:.0f} s</text>']
    for i, (rank, points) in enumerate(sorted(series.items())):
        colour = PALETTE[i % len(PALETTE)]
        path = " ".join(f"{_num(x(t))},{_num(y(v))}" for t, v in points)
        last = points[-1][1]
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}">'
                     f'<title>rank {rank}</title></polyline>')
        if len(points) == 1:
            parts.append(f'<circle cx="{_num(x(points[0][0]))}" cy="{_num(y(last))}" r="3" fill="{colour}"/>')
        parts.append(f'<text x="{left + 6 + 90 * (i % 6)}" y="{up + 12 + 12 * (i // 6)}" fill="{colour}" '
                     f'class="legend" data-rank="{rank}">rank {rank}: {last:.2f}/s</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def mean_bars(means: Mapping[int, float], *, width: int = 560) -> Markup:
    top = max(means.values()) or 1.0
    left, row = 64, 18
    parts = [f'<svg class="chart" role="img" aria-label="mean steps per second per rank" width="{width}" '
             f'height="{row * len(means) + 4}" viewBox="0 0 {width} {row * len(means) + 4}">']
    for i, (rank, value) in enumerate(sorted(means.items())):
        w = (width - left - 150) * value / top
        parts.append(f'<text x="{left - 6}" y="{i * row + 14}" text-anchor="end" class="host">rank {rank}</text>'
                     f'<rect x="{left}" y="{i * row + 3}" width="{_num(max(1.0, w))}" height="13" '
                     f'fill="{PALETTE[i % len(PALETTE)]}"/>'
                     f'<text x="{_num(left + w + 6)}" y="{i * row + 14}" class="legend" data-rank="{rank}">'
                     f'{value:.2f} steps/s (mean)</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def timeline(changes: Sequence[Mapping[str, Any]], *, end: float | None, width: int = 760) -> Markup:
    """Membership: one row per host, a bar while it was a member, a mark at each change (red: lost)."""
    points = [{**c, "hosts": [str(h) for h in c["hosts"]] if isinstance(c.get("hosts"), list) else []}
              for c in changes if isinstance(c.get("time"), (int, float))]
    if not points:
        return Markup('<p class="none">not an elastic run: its hosts stayed the same</p>')
    t0 = min(float(c["time"]) for c in points)
    t1 = max([float(c["time"]) for c in points] + ([end] if end else []))
    hosts: list[str] = []
    for c in points:
        for host in [*(c.get("hosts") or []), *([c["host"]] if c.get("host") else [])]:
            if str(host) not in hosts:
                hosts.append(str(host))
    label, right, row = 130, 70, 22
    w = width - label - right
    height = row * len(hosts) + 26

    def x(t: float) -> float:
        return label + (w * (t - t0) / (t1 - t0) if t1 > t0 else 0)

    parts = [f'<svg class="chart" role="img" aria-label="membership timeline" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">']
    for i, host in enumerate(hosts):
        top = 4 + i * row
        parts.append(f'<text x="{label - 6}" y="{top + 14}" text-anchor="end" class="host">{escape(host)}</text>')
        member_since = None
        for c in points:
            inside = host in [str(h) for h in (c.get("hosts") or [])]
            if inside and member_since is None:
                member_since = float(c["time"])
            elif not inside and member_since is not None:
                parts.append(_bar(x(member_since), x(float(c["time"])), top))
                member_since = None
        if member_since is not None:
            parts.append(_bar(x(member_since), x(t1), top))
        for c in points:
            if str(c.get("host")) == host and c.get("change") in ("left", "joined"):
                colour = CHANGE_COLOURS.get(str(c["change"]), "#333")
                cx = x(float(c["time"]))
                what = f"{host} {c['change']}: {c.get('why') or ''}"
                parts.append(f'<g class="change change-{escape(str(c["change"]))}" data-host="{escape(host)}">'
                             f'<title>{escape(what)}</title>'
                             f'<circle cx="{_num(cx)}" cy="{top + 10}" r="6" fill="{colour}"/>'
                             f'<text x="{_num(min(cx + 9, width - 4))}" y="{top + 14}" class="mark" '
                             f'fill="{colour}">{escape(str(c["change"]))}</text></g>')
    parts.append(f'<text x="{label}" y="{height - 4}" class="axis">0 s</text>'
                 f'<text x="{label + w}" y="{height - 4}" text-anchor="end" class="axis">{t1 - t0:.0f} s</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _bar(a: float, b: float, top: int) -> str:
    return f'<rect x="{_num(a)}" y="{top + 4}" width="{_num(max(1.0, b - a))}" height="12" fill="#a6d5a6" rx="2"/>'


def goodput_bar(data: Mapping[str, Any] | None, *, width: int = 760) -> Markup:
    """Where the host-seconds went: one bar, a segment per class above zero, and its legend."""
    seconds = data.get("seconds") if data else None
    if not isinstance(seconds, Mapping):
        return Markup('<p class="none">no goodput yet: it is known from the run\'s start record on</p>')
    shown = {k: float(v) for k, v in seconds.items() if isinstance(v, (int, float)) and v > 0}
    total = sum(shown.values())
    if total <= 0:
        return Markup('<p class="none">no host-seconds recorded</p>')
    parts = [f'<svg class="chart" role="img" aria-label="goodput" width="{width}" height="26" '
             f'viewBox="0 0 {width} 26">']
    at = 0.0
    for name, value in shown.items():
        w = width * value / total
        parts.append(f'<rect x="{_num(at)}" y="2" width="{_num(w)}" height="22" '
                     f'fill="{GOODPUT_COLOURS.get(name, "#555")}"><title>{escape(name)} {value:.1f} host-s'
                     f'</title></rect>')
        at += w
    parts.append("</svg>")
    legend = "".join(f'<span class="key"><i style="background:{GOODPUT_COLOURS.get(n, "#555")}"></i>'
                     f'{escape(n)} {v:.1f} s ({100 * v / total:.0f} %)</span>' for n, v in shown.items())
    share = data.get("goodput")
    head = f"goodput {100 * share:.1f} %" if isinstance(share, (int, float)) else "goodput -"
    return Markup(f'<p class="goodput-head"><b>{head}</b> of {total:.1f} host-s</p>{"".join(parts)}'
                  f'<p class="legend">{legend}</p>')
