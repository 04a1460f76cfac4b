"""Charts for the benchmarks' results, as SVG written with the standard library (no plotting dependency).

`grouped_bars` draws one group of bars per row (a workload, a router) and one bar per series in each group,
with the values written above the bars, a legend and a y axis: what the docs show beside each table.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

PALETTE = ("#9aa5b1", "#2f6fde", "#1b9e5a", "#e08a1e", "#b54a9b")


def grouped_bars(title: str, groups: list[str], series: dict[str, list[float]], *, unit: str = "%",
                 y_max: float | None = None, width: int = 900, height: int = 360) -> str:
    """An SVG document: for each group, one bar per series (`series[name][i]` is group i's value)."""
    names = list(series)
    top = y_max if y_max is not None else max((v for values in series.values() for v in values), default=1.0) or 1.0
    left, right, upper, lower = 56, 16, 48, 64
    plot_w, plot_h = width - left - right, height - upper - lower
    group_w = plot_w / max(1, len(groups))
    bar_w = group_w * 0.8 / max(1, len(names))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14" font-weight="bold">{escape(title)}</text>']
    for step in range(5):  # y axis: five gridlines
        value = top * step / 4
        y = upper + plot_h - plot_h * step / 4
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#e3e6ea"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{value:g}{escape(unit)}</text>')
    for g, group in enumerate(groups):
        x0 = left + g * group_w + group_w * 0.1
        for s, name in enumerate(names):
            value = series[name][g]
            h = plot_h * min(value, top) / top
            x, y = x0 + s * bar_w, upper + plot_h - h
            colour = PALETTE[s % len(PALETTE)]
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w - 1:.1f}" height="{h:.1f}" fill="{colour}">'
                       f'<title>{escape(group)}: {escape(name)} {value:.1f}{escape(unit)}</title></rect>')
            out.append(f'<text x="{x + bar_w / 2:.1f}" y="{y - 3:.1f}" text-anchor="middle" font-size="9">'
                       f'{_figure(value)}</text>')
        out.append(f'<text x="{left + g * group_w + group_w / 2:.1f}" y="{upper + plot_h + 16}" '
                   f'text-anchor="middle">{escape(group)}</text>')
    for s, name in enumerate(names):  # legend, under the axis
        x = left + s * 170
        out.append(f'<rect x="{x}" y="{height - 22}" width="12" height="12" fill="{PALETTE[s % len(PALETTE)]}"/>')
        out.append(f'<text x="{x + 16}" y="{height - 12}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _figure(value: float) -> str:
    """A bar's figure: whole numbers from 10 up, two significant digits below (0.15 ms, not 0)."""
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.2g}"


def write(path: Path, svg: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg)
    return path
