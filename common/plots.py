"""What every figure the project writes shares: one colour per topology, curves of one point that still show, and
tick labels that read as plain numbers.

* :data:`TOPOLOGY_COLORS`: the colour of each topology (its registration's), the same in the demo's loss curves, the
  comparison reports' and the diagnostics; :func:`color_for` finds the topology in a label (``"siamese"``,
  ``"DeiT siamese"``, ``"deit_siamese"``).
* :func:`series_style`: the rest of a curve's style: each of a run's several streams (Hyper-Connections' ``n``) its
  own dash and marker, and Pre-Norm, the baseline, a wide band behind the others, so that curves lying on it leave it
  visible.
* :func:`plot_series`: a curve; with one finite point, a marker and its value written beside it (a line through one
  point draws nothing).
* :func:`plain_ticks`: no offset (``+1``, ``1e3``) or scientific labels on linear axes, and plain numbers instead of
  ``8x10^0`` on log axes.
"""
from __future__ import annotations

import math
import re
from typing import Optional, Sequence

from common.topologies import TOPOLOGIES

TOPOLOGY_COLORS = {name: topology.color for name, topology in TOPOLOGIES.items()}


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (plots are written, never shown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def topology_of(label: str) -> Optional[str]:
    """The topology a label names as one of its words (``"DeiT siamese"``, ``"dit_pre"``); None if none or several."""
    names = "|".join(sorted(TOPOLOGY_COLORS, key=len, reverse=True))  # the longest name first: attnres_block, not attnres
    found = set(re.findall(rf"(?<![a-z0-9])({names})(?![a-z0-9])", label.lower()))
    return found.pop() if len(found) == 1 else None


def color_for(label: str) -> Optional[str]:
    """The topology's colour (None for a label that names no topology: matplotlib's next colour)."""
    topology = topology_of(label)
    return TOPOLOGY_COLORS[topology] if topology else None


BASELINE = "pre"  # the topology every other one is read against
STREAM_DASHES = ("-", "--", "-.", ":")
STREAM_MARKERS = ("o", "s", "^", "v")


def series_style(label: str, stream: int = 0, streams: int = 1) -> dict:
    """``plot_series`` keywords for the curve ``label`` names (its stream ``stream`` of ``streams``): the topology's
    colour; several streams of one run each their own dash and marker; the baseline (Pre-Norm) a wide, light band
    drawn behind the other curves, which would otherwise hide it where they coincide."""
    style = {"color": color_for(label)}
    if streams > 1:
        style.update(ls=STREAM_DASHES[stream % len(STREAM_DASHES)], marker=STREAM_MARKERS[stream % len(STREAM_MARKERS)])
    if topology_of(label) == BASELINE:
        style.update(lw=4, alpha=0.45, zorder=1.5)  # lines draw at zorder 2: the others on top of it
    return style


def plot_series(ax, xs: Sequence[float], ys: Sequence[float], label: Optional[str] = None, color: Optional[str] = None,
                marker: Optional[str] = None, **kwargs):
    """``ax.plot`` of a curve (non-finite values are gaps). A curve with one finite point is drawn as a marker with
    its value beside it. Returns the line."""
    ys = [float(v) if v is not None and math.isfinite(v) else float("nan") for v in ys]
    finite = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
    single = len(finite) == 1
    (line,) = ax.plot(xs, ys, label=label, color=color, marker=marker or ("o" if single else None), **kwargs)
    if single:
        x, y = finite[0]
        ax.annotate(f"{y:.4g}", (x, y), textcoords="offset points", xytext=(5, 5), fontsize=7,
                    color=line.get_color())
    return line


def plain_ticks(ax) -> None:
    """Tick labels as plain numbers: no offset or scientific notation on linear axes, ``0.8`` rather than
    ``8x10^-1`` on log axes (major and minor ticks; matplotlib still thins the minor labels)."""
    from matplotlib.ticker import LogFormatter, ScalarFormatter

    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "log":
            axis.set_major_formatter(LogFormatter())
            axis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        else:
            formatter = ScalarFormatter(useOffset=False)
            formatter.set_scientific(False)
            axis.set_major_formatter(formatter)
