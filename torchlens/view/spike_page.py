"""The page of a loss spike (`Spike.html`): the magnitude of every module's output, and of its
gradient, on the spiking batch against the healthy batch, across the model's depth.

Drawn on the server as SVG, with no script: each series is the RMS of each module call's output,
in the order the modules returned (the gradients: in the order they arrived), on a log scale, so a
blow-up shows as the point where the spiking batch's line leaves the healthy one and stays above
it. The first module out of range is marked; a table below gives the numbers.
"""

from __future__ import annotations

import html
import math
from typing import List, Optional, Sequence, Tuple

__all__ = ["spike_page"]

_WIDTH, _HEIGHT, _PAD = 900, 260, 48
_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #1d1d1f; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
.line { font-family: ui-monospace, monospace; background: #f4f4f6; padding: 8px 10px; white-space: pre-wrap; }
table { border-collapse: collapse; margin-top: 8px; } td, th { padding: 2px 10px; text-align: right; }
td:first-child, th:first-child { text-align: left; font-family: ui-monospace, monospace; }
tr.off td { background: #fde8e8; } .spike { color: #c62828; } .healthy { color: #555; }
"""


def spike_page(spike) -> str:
    """The whole HTML document of `spike` (a `watching.Spike`)."""
    spiked, healthy = spike.magnitudes if spike.magnitudes is not None else (None, None)
    parts = [f"<h1>torchlens watch: step {spike.step}, a {html.escape(spike.which)} spike</h1>",
             f'<p class="line">{html.escape(str(spike))}</p>']
    if spiked is None:
        parts.append("<p>No replay measured the modules (see the line).</p>")
    for title, measured in (("Outputs", "outputs"), ("Gradients", "gradients")):
        series = getattr(spiked, measured) if spiked is not None else []
        if not series:
            continue
        reference = dict(getattr(healthy, measured)) if healthy is not None else {}
        marked = spike.module if spike.measured == measured[:-1] else None
        parts.append(f"<h2>{title}: RMS of each module's {measured[:-1]}, in the order computed</h2>")
        parts.append(_chart(series, reference, marked))
        parts.append(_table(series, reference, marked))
    files = [path for path in [spike.inputs, *spike.traces] if path]
    if files:
        parts.append("<h2>Files</h2><ul>" + "".join(f"<li>{html.escape(p)}</li>" for p in files) + "</ul>")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>torchlens: spike at step {spike.step}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
            + "\n".join(parts) + "\n</body>\n</html>\n")


def _log(value: Optional[float]) -> Optional[float]:
    if value is None or not math.isfinite(value) or value <= 0:
        return None
    return math.log10(value)


def _chart(series: Sequence[Tuple[str, float]], reference: dict, marked: Optional[str]) -> str:
    spiked = [_log(v) for _, v in series]
    healthy = [_log(reference.get(name)) for name, _ in series]
    known = [v for v in spiked + healthy if v is not None]
    if not known:
        return "<p>No finite magnitude to draw.</p>"
    low, high = min(known), max(known)
    high = high if high > low else low + 1
    count = max(len(series) - 1, 1)

    def point(i: int, v: float) -> str:
        x = _PAD + (_WIDTH - 2 * _PAD) * i / count
        y = _HEIGHT - _PAD - (_HEIGHT - 2 * _PAD) * (v - low) / (high - low)
        return f"{x:.1f},{y:.1f}"

    lines = []
    for values, colour in ((healthy, "#888"), (spiked, "#c62828")):
        points = " ".join(point(i, v) for i, v in enumerate(values) if v is not None)
        lines.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>')
    names = [name for name, _ in series]
    where = spiked[names.index(marked)] if marked is not None and marked in names else None
    if marked is not None and where is not None:
        x, y = point(names.index(marked), where).split(",")
        lines.append(f'<circle cx="{x}" cy="{y}" r="5" fill="none" stroke="#c62828" stroke-width="2"/>')
        label = html.escape(marked)
        lines.append(f'<text x="{x}" y="{float(y) - 10:.1f}" font-size="12" fill="#c62828">{label}</text>')
    axis = (f'<text x="4" y="{_PAD}" font-size="11">{10 ** high:.3g}</text>'
            f'<text x="4" y="{_HEIGHT - _PAD}" font-size="11">{10 ** low:.3g}</text>'
            f'<text x="{_PAD}" y="{_HEIGHT - 12}" font-size="11">first module</text>'
            f'<text x="{_WIDTH - _PAD - 70}" y="{_HEIGHT - 12}" font-size="11">last module</text>'
            f'<text x="{_WIDTH - 260}" y="16" font-size="12"><tspan class="spike" fill="#c62828">the spiking batch'
            f'</tspan> · <tspan fill="#888">the healthy batch</tspan></text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
            f'viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" aria-label="module magnitudes">'
            + axis + "".join(lines) + "</svg>")


def _table(series: Sequence[Tuple[str, float]], reference: dict, marked: Optional[str]) -> str:
    rows: List[str] = ["<tr><th>module</th><th>spiking batch</th><th>healthy batch</th><th>ratio</th></tr>"]
    for name, value in series:
        ref = reference.get(name)
        ratio = (value / ref if ref else math.inf) if ref is not None else None
        cls = ' class="off"' if name == marked else ""
        rows.append(f"<tr{cls}><td>{html.escape(name)}</td><td>{value:.4g}</td>"
                    f"<td>{'' if ref is None else f'{ref:.4g}'}</td>"
                    f"<td>{'' if ratio is None else f'x{ratio:.3g}'}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"
