"""Every figure the project writes (the demo's loss curves, the comparison reports', the diagnostics): one colour per
topology from common.plots, a curve of one logged point drawn as a marker with its value, no offset tick labels.
Checked on the figure objects, not on pixels."""
import math

import pytest
from matplotlib.colors import to_hex

from common.diagnostics import diagnostic_figure
from common.plots import TOPOLOGY_COLORS, color_for, topology_of
from comparison.report import loss_curves_figure
from scripts.demo import loss_figure


def run(topology, curve, seed=0):
    return {"topology": topology, "depth": 2, "lr": 1e-3, "seed": seed, "loss_curve": curve}


def figures(curve_pre, curve_siamese):
    """The same two curves through every plotting site, labelled as each site labels them."""
    steps_pre, values_pre = zip(*curve_pre)
    steps_siamese, values_siamese = zip(*curve_siamese)
    grad = {"deit_pre": {"steps": list(steps_pre), "grad_norm": list(values_pre), "loss": list(values_pre)},
            "deit_siamese": {"steps": list(steps_siamese), "grad_norm": list(values_siamese),
                             "loss": list(values_siamese)}}
    removal = {"pre": {"layers": list(steps_pre), "loss_increase": list(values_pre)},
               "siamese": {"layers": list(steps_siamese), "loss_increase": list(values_siamese)}}
    return {
        "demo": loss_figure({"DeiT pre": curve_pre, "DeiT siamese": curve_siamese}),
        "compare report": loss_curves_figure([run("pre", curve_pre), run("siamese", curve_siamese)]),
        "grad_norm diagnostic": diagnostic_figure("grad_norm", grad),
        "layer_removal diagnostic": diagnostic_figure("layer_removal", removal),
    }


def labelled_lines(fig):
    return [line for ax in fig.axes for line in ax.get_lines() if not line.get_label().startswith("_")]


def test_one_colour_per_topology_in_every_plot():
    assert topology_of("DeiT siamese") == topology_of("deit_siamese") == topology_of("siamese") == "siamese"
    assert topology_of("pre vs siamese") is None and color_for("baseline") is None
    assert topology_of("dit attnres_block") == "attnres_block" and topology_of("deit_attnres") == "attnres"
    assert topology_of("mhc d12") == "mhc"
    assert len(set(TOPOLOGY_COLORS.values())) == len(TOPOLOGY_COLORS)  # no two topologies share a colour
    curve = [(1, 2.0), (2, 1.5), (3, 1.2)]
    for site, fig in figures(curve, [(1, 2.1), (2, 1.4), (3, 1.1)]).items():
        seen = {}
        for line in labelled_lines(fig):
            seen.setdefault(topology_of(line.get_label()), set()).add(to_hex(line.get_color()))
        assert seen == {"pre": {to_hex(TOPOLOGY_COLORS["pre"])},
                        "siamese": {to_hex(TOPOLOGY_COLORS["siamese"])}}, (site, seen)


def test_a_curve_of_one_logged_point_shows_a_marker_and_its_value():
    for site, fig in figures([(4, 0.7)], [(1, 2.0), (2, 1.5)]).items():
        (single,) = [line for line in labelled_lines(fig) if topology_of(line.get_label()) == "pre"]
        assert single.get_marker() not in (None, "None", "", " "), site
        assert list(single.get_xdata()) == [4] and list(single.get_ydata()) == [0.7], site
        texts = [t.get_text() for ax in fig.axes for t in ax.texts]
        assert "0.7" in texts, (site, texts)


@pytest.mark.parametrize("curve_pre, curve_siamese", [
    ([(2000, 1.0001), (2001, 1.0002)], [(2000, 1.0003), (2001, 1.0004)]),  # matplotlib would label "+1" / "1e3"
    ([(1, 8.1), (2, 8.3)], [(1, 8.2), (2, 8.4)]),                           # a log axis within one decade: "8x10^0"
])
def test_tick_labels_are_plain_numbers(curve_pre, curve_siamese):
    for site, fig in figures(curve_pre, curve_siamese).items():
        fig.canvas.draw()
        for ax in fig.axes:
            for axis in (ax.xaxis, ax.yaxis):
                assert axis.get_major_formatter().get_offset() == "", (site, axis.get_major_formatter().get_offset())
                labels = [t.get_text() for t in axis.get_ticklabels() + axis.get_ticklabels(minor=True)]
                for text in labels:
                    assert "times" not in text and "^" not in text and "e+" not in text, (site, labels)
                    assert not text.startswith("+"), (site, labels)
                shown = [float(t.replace("\N{MINUS SIGN}", "-")) for t in labels if t]
                assert shown and all(math.isfinite(v) for v in shown), (site, labels)


def test_every_stream_of_a_run_has_its_own_legend_entry_and_style_and_pre_norm_stays_visible():
    """Hyper-Connections' n streams and Attention Residuals' newest source, named in the legend (not "mhcs0",
    "attnres_blockv"), each stream its own dash and marker in its topology's colour; Pre-Norm a wide band drawn
    behind the curves that lie on it."""
    layers = [0, 1, 2]
    results = {"deit_pre": {"layers": layers, "norms": {"h": [1.0, 2.0, 3.0]}},
               "deit_mhc": {"layers": layers, "norms": {f"s{i}": [1.0, 2.0, 3.0] for i in range(4)}},
               "deit_attnres_block": {"layers": layers, "norms": {"v": [1.0, 0.5, 0.5]}},
               "deit_siamese": {"layers": layers, "norms": {"x": [1.0, 1.0, 1.0], "y": [1.0, 2.0, 3.0]}}}
    fig = diagnostic_figure("hidden_state_norms", results)
    lines = {line.get_label(): line for line in labelled_lines(fig)}
    assert list(lines) == ["deit_pre", "deit_mhc stream 1", "deit_mhc stream 2", "deit_mhc stream 3", "deit_mhc stream 4",
                           "deit_attnres_block newest source", "deit_siamese X (post-norm stream)",
                           "deit_siamese Y (pre-norm stream)"]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == list(lines)
    streams = [lines[f"deit_mhc stream {i}"] for i in range(1, 5)]
    assert {to_hex(s.get_color()) for s in streams} == {to_hex(TOPOLOGY_COLORS["mhc"])}
    assert len({(s.get_linestyle(), s.get_marker()) for s in streams}) == 4  # told apart without colour
    assert to_hex(lines["deit_attnres_block newest source"].get_color()) == to_hex(TOPOLOGY_COLORS["attnres_block"])
    pre = lines["deit_pre"]
    others = [line for label, line in lines.items() if label != "deit_pre"]
    assert all(pre.get_zorder() < line.get_zorder() and pre.get_linewidth() > line.get_linewidth() for line in others)
