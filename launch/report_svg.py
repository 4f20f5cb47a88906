"""Inline SVG line charts and the page frame of `launch report`: standard library only.

The report must open anywhere, offline, years later (an archived run directory, a laptop, a mail
attachment), so nothing is fetched: every chart is an SVG element written into the page and the style
sheet is inline. No script either: hovering a point shows its value through SVG `<title>` tooltips,
which every browser renders natively, and the trajectory view folds with `<details>`.

`line_chart(title, series, ...)` draws one or more series of (x, y) points on shared axes with "nice"
tick values (1, 2, 5 x 10^k), a legend, and dashed vertical markers (restarts of the run). Points with a
non-finite y are skipped; a series of one point is drawn as a dot. A chart shares one y axis, so the
caller puts only series of one unit and one scale together (the trainer's tokens/s, thousands, and the
servers' generated tokens/s, tens, are two charts: on one axis the smaller is a flat line at zero).

`robust=True` is for series where a few points are expected far above the rest, like a step's wait
for its batch at start-up (model load, the servers' first start, a restart): the y axis then ends at
ROBUST_FACTOR x the ROBUST_QUANTILE quantile of the values instead of their maximum, the points above it
are drawn on the top edge as open triangles (their tooltip gives the true value) and the chart's note
names them. Otherwise one 40 s start-up wait would squash every later 1 s step onto the x axis.

Everything drawn comes from files someone else could have written, so nothing here trusts a value: every
text goes through `esc` (and `clip`, which cuts a long one with a visible marker), tick positions are
computed by index from a bounded count (steps near 1e16, where adding a step to a float changes nothing,
once made the tick loop spin forever), an axis whose values float arithmetic cannot tell apart is widened
before it is divided by, and the pixel mapping works on halves so that values near the end of the float
range do not overflow. A series of more than MAX_POINTS points is thinned to every k-th point (the last
kept), with a note, so a run of a million steps still makes a page of bounded size.
"""
from __future__ import annotations

import html
import math
import numbers
import sys
from typing import Iterable, Sequence

W, H = 560, 230                     # the chart's box in px; the plot area leaves room for axes and legend
PAD_L, PAD_R, PAD_T, PAD_B = 58, 14, 30, 40
MAX_POINTS = 2000                   # per series; beyond, every k-th point is drawn
MAX_LABEL = 80                      # characters of a legend label or caption shown
ROBUST_QUANTILE, ROBUST_FACTOR, ROBUST_MIN_POINTS = 0.75, 3.0, 5   # robust=True: the y axis's top
_FMAX = sys.float_info.max
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4d7c0f", "#be185d")


def esc(x) -> str:
    return html.escape(str(x), quote=True)


def clip(text, limit: int) -> str:
    """`text` (any value, as str) cut to `limit` characters, the cut marked with how much was left out."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters not shown]"


def fmt(v) -> str:
    """A short human number: 3 significant digits, k/M for large values, scientific for tiny ones."""
    v = finite(v)  # None, a string, NaN or an int past the float range: "-"
    if v is None:
        return "-"
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a >= 100:
        return f"{v:.0f}"
    if a < 1e-3:
        return f"{v:.2e}"
    return f"{v:.3g}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round tick values covering [lo, hi], at least two, at most n + 2; ValueError for a
    non-finite bound. Any finite range: one value or a spread too narrow for its magnitude gets a wider
    range, and values beyond 1e300 are ticked on a scaled copy (a round tick past them may not exist as
    a float, so the top one is clamped to the largest float)."""
    if finite(lo) is None or finite(hi) is None:
        raise ValueError(f"axis range [{lo}, {hi}] is not finite")
    lo, hi = float(lo), float(hi)
    lo, hi = min(lo, hi), max(lo, hi)
    m = max(abs(lo), abs(hi))
    if m > 1e300:
        out: list[float] = []
        for t in nice_ticks(lo / 1e20, hi / 1e20, n):
            t = max(min(t * 1e20, _FMAX), -_FMAX)
            if not out or t > out[-1]:
                out.append(t)
        return out if len(out) > 1 else [out[0] / 2, out[0]]
    if hi - lo <= max(m * 1e-9, 1e-280):   # one value, or a spread float arithmetic does not resolve
        hi = lo + (abs(lo) if abs(lo) >= 1e-280 else 1.0)
    raw = (hi - lo) / max(n - 1, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next((k * mag for k in (1, 2, 2.5, 5, 10) if k * mag >= raw), 10 * mag)
    while step < raw:  # log10 rounded down a power
        step *= 10
    first = math.floor(lo / step) * step
    # ticks by index, from a count fixed up front: `t += step` stops moving once step < ulp(t)
    count = max(2, math.ceil((hi - first) / step - 1e-9) + 1)
    digits = 3 - math.floor(math.log10(step))  # enough to drop float noise (0.30000000000000004)
    return [round(first + i * step, digits) for i in range(min(count, n + 2))]


def _span(lo: float, hi: float) -> tuple[float, float]:
    """[lo, hi] widened where float arithmetic cannot tell its ends apart (one value; steps near 1e16)."""
    m = max(abs(lo), abs(hi))
    if hi - lo > m * 1e-9:
        return lo, hi
    pad = max(1.0, m * 1e-6)
    return max(lo - pad, -_FMAX), min(hi + pad, _FMAX)


def _thin(p: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(p) <= MAX_POINTS:
        return p
    k = -(-len(p) // MAX_POINTS)
    return p[::k] + ([p[-1]] if (len(p) - 1) % k else [])


def finite(v) -> float | None:
    """`v` as a finite float; None for anything else (a string, a bool, NaN, an int past the float range)."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _point(p) -> tuple[float | None, float | None]:
    x, y = p
    return finite(x), finite(y)


def robust_top(ys: Sequence[float]) -> float | None:
    """The top of a robust y axis for `ys` (module docstring), or None where the maximum is no outlier
    (too few points, or nothing above ROBUST_FACTOR x the quantile)."""
    if len(ys) < ROBUST_MIN_POINTS:
        return None
    srt = sorted(ys)
    q = srt[int(ROBUST_QUANTILE * (len(srt) - 1))]   # a quarter of the points may be outliers
    cap = q * ROBUST_FACTOR if q > 0 else None
    return cap if cap is not None and srt[-1] > cap else None


def line_chart(title: str, series: Sequence[tuple[str, Sequence[tuple[float, float]]]], *,
               y_label: str = "", x_label: str = "step", markers: Iterable[tuple[float, str]] = (),
               note: str = "", robust: bool = False) -> str:
    """One SVG chart. `series`: (label, [(x, y), ...]); `markers`: (x, label) dashed vertical lines;
    `robust`: the y axis ends below outliers, drawn on its top edge (module docstring)."""
    series = [(clip(label, MAX_LABEL), s) for label, s in series]
    x_label = clip(x_label, MAX_LABEL)
    full = [[(x, y) for x, y in map(_point, s) if x is not None and y is not None] for _, s in series]
    pts = [_thin(p) for p in full]
    if any(len(a) != len(b) for a, b in zip(full, pts)):
        most = max(len(p) for p in full)
        thinned = f"{most} points, one in {-(-most // MAX_POINTS)} drawn"
        note = f"{note}; {thinned}" if note else thinned
    allp = [p for s in pts for p in s]
    head = f'<figure class="chart"><figcaption>{esc(clip(title, MAX_LABEL))}</figcaption>'
    if not allp:
        return head + f'<div class="empty">no data in this run{": " + esc(note) if note else ""}</div></figure>'
    markers = [(x, label) for x, label in ((finite(x), label) for x, label in markers) if x is not None]
    xs = [p[0] for p in allp] + [m[0] for m in markers]
    ys = [p[1] for p in allp]
    lo, hi = min(xs), max(xs)
    # a single step shows its neighbours; a span too narrow for float arithmetic is widened
    x0, x1 = (lo - 1, hi + 1) if lo == hi and abs(lo) < 1e15 else _span(lo, hi)
    cap = robust_top(ys) if robust else None
    yt = nice_ticks(min(ys), max(ys) if cap is None else cap)
    y0, y1 = yt[0], yt[-1]
    # only a robust axis cuts: elsewhere the top tick's rounding may leave the maximum an ulp above it
    above = [(label, x, y) for (label, _), p in zip(series, pts) for x, y in p if cap is not None and y > y1]
    if above:
        shown = "; ".join(f"{label} @ {x_label} {fmt(x)}: {fmt(y)}" for label, x, y in above[:6])
        more = f" and {len(above) - 6} more" if len(above) > 6 else ""
        cut = (f"y axis cut at {fmt(y1)} (above {ROBUST_FACTOR:g} x the {ROBUST_QUANTILE:.0%} quantile of the "
               f"values); drawn on the top edge: {shown}{more}")
        note = f"{note}; {cut}" if note else cut
    # legend entries left to right, wrapped into rows; the plot starts below the last row
    legend, lx, row = [], PAD_L, 0
    for label, _ in series:
        width = 24 + 6.5 * len(label)
        if lx + width > W - PAD_R and lx > PAD_L:
            lx, row = PAD_L, row + 1
        legend.append((lx, 8 + 15 * row))
        lx += width
    top = PAD_T + 15 * row
    pw, ph = W - PAD_L - PAD_R, H - top - PAD_B

    # halves: x - x0 may overflow when the values span most of the float range
    def sx(x):
        return PAD_L + (x / 2 - x0 / 2) / (x1 / 2 - x0 / 2) * pw

    def sy(y):
        return top + ph - (y / 2 - y0 / 2) / (y1 / 2 - y0 / 2) * ph

    out = [head, f'<svg viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
                 f'aria-label="{esc(clip(title, MAX_LABEL))}" xmlns="http://www.w3.org/2000/svg">']
    for t in yt:  # horizontal grid and y tick labels
        y = sy(t)
        out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{esc(fmt(t))}</text>')
    for t in nice_ticks(x0, x1, 6):
        if x0 <= t <= x1:
            x = sx(t)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + ph}" y2="{top + ph + 4}" class="axis"/>'
                       f'<text x="{x:.1f}" y="{top + ph + 16}" class="tick" text-anchor="middle">'
                       f'{esc(fmt(t))}</text>')
    out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{top + ph}" y2="{top + ph}" class="axis"/>'
               f'<line x1="{PAD_L}" x2="{PAD_L}" y1="{top}" y2="{top + ph}" class="axis"/>'
               f'<text x="{PAD_L + pw / 2:.1f}" y="{H - 6}" class="label" text-anchor="middle">{esc(x_label)}</text>')
    if y_label:
        out.append(f'<text x="12" y="{top + ph / 2:.1f}" class="label" text-anchor="middle" '
                   f'transform="rotate(-90 12 {top + ph / 2:.1f})">{esc(clip(y_label, MAX_LABEL))}</text>')
    for x, label in markers:
        out.append(f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{top}" y2="{top + ph}" class="marker">'
                   f'<title>{esc(clip(label, 300))}</title></line>')
    for i, ((label, _), p, (lx, ly)) in enumerate(zip(series, pts, legend)):
        c = COLORS[i % len(COLORS)]
        if len(p) > 1:
            path = " ".join(f"{sx(x):.1f},{sy(y if cap is None else min(y, y1)):.1f}" for x, y in p)
            out.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="1.6"/>')
        r = 2.2 if len(p) < 80 else 1.2
        for x, y in p:
            tip = f'<title>{esc(label)} @ {esc(x_label)} {esc(fmt(x))}: {esc(fmt(y))}</title>'
            if cap is not None and y > y1:  # above a robust axis: an open triangle on the top edge, the true value in its tooltip
                px, py = sx(x), sy(y1)
                out.append(f'<polygon points="{px - 4:.1f},{py + 3:.1f} {px + 4:.1f},{py + 3:.1f} {px:.1f},{py - 4:.1f}" '
                           f'fill="#fff" stroke="{c}" stroke-width="1.4" class="above">{tip}</polygon>')
            else:
                out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="{r}" fill="{c}">{tip}</circle>')
        out.append(f'<rect x="{lx:.0f}" y="{ly}" width="10" height="10" fill="{c}"/>'
                   f'<text x="{lx + 14:.0f}" y="{ly + 9}" class="legend">{esc(label)}</text>')
    out.append("</svg>")
    if note:
        out.append(f'<div class="note">{esc(clip(note, 600))}</div>')
    out.append("</figure>")
    return "".join(out)


CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#111;background:#f6f7f9}
header{background:#111827;color:#f9fafb;padding:14px 24px}
header h1{font-size:19px;margin:0 0 4px}
header .sub{color:#cbd5e1;font-size:13px}
main{padding:8px 24px 40px;max-width:1820px}
h2{font-size:16px;margin:26px 0 8px;border-bottom:1px solid #d1d5db;padding-bottom:4px}
table.kv{border-collapse:collapse;background:#fff}
table.kv td,table.kv th{border:1px solid #e5e7eb;padding:3px 10px;text-align:left;vertical-align:top}
table.kv th{background:#f3f4f6;font-weight:600}
.charts{display:flex;flex-wrap:wrap;gap:12px}
figure.chart{margin:0;background:#fff;border:1px solid #e5e7eb;border-radius:6px;padding:6px}
figure.chart figcaption{font-weight:600;font-size:13px;margin:0 0 2px 4px}
.empty{width:540px;height:60px;color:#6b7280;padding:10px}
.note{color:#6b7280;font-size:12px;max-width:540px;margin:2px 4px}
svg .grid{stroke:#eef0f3}
svg .axis{stroke:#9ca3af}
svg .tick{font-size:10px;fill:#4b5563}
svg .label{font-size:11px;fill:#374151}
svg .legend{font-size:11px;fill:#111}
svg .marker{stroke:#f59e0b;stroke-dasharray:4 3;stroke-width:1.5}
details.step{background:#fff;border:1px solid #e5e7eb;border-radius:6px;margin:8px 0;padding:4px 10px}
details.step>summary{cursor:pointer;font-weight:600}
.episode{border-top:1px solid #e5e7eb;padding:8px 0}
.episode .head{font-size:13px;color:#374151;margin-bottom:4px}
.seg{white-space:pre-wrap;word-break:break-word;font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,monospace;
     border-radius:4px;padding:4px 6px;margin:3px 0}
.seg .tag{font:600 11px system-ui,sans-serif;color:#374151;display:block;margin-bottom:2px}
.prompt{background:#f3f4f6}
.model{background:#eef6ff;border-left:3px solid #2563eb}
.obs{background:#fff7ed;border-left:3px solid #ea580c}
.v0{background:#dcfce7}.v1{background:#fef9c3}.v2{background:#fed7aa}.v3{background:#fecaca}
.vm{background:#e5e7eb;color:#6b7280}
.tool{outline:1px solid #9333ea;background:#f3e8ff}
.legendrow span{display:inline-block;padding:0 6px;margin-right:6px;border-radius:3px;font-size:12px}
.warn{color:#b45309}
"""


def page(title: str, subtitle: str, body: str) -> str:
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head><body><header><h1>{esc(title)}</h1>"
            f"<div class=\"sub\">{esc(subtitle)}</div></header><main>{body}</main></body></html>")
