"""The report of a topology comparison (``scripts.compare``): tables, paired differences, the paper's claims judged
by stated rules, loss curves (every run and the mean over seeds), diagnostics and per-run speed.

    write_report(results, runs_dir, report_dir, task)   # report.md, summary.json, loss_curves.png, diagnostics_*/

``results`` are the ``result.json`` of finished runs (``scripts.compare`` writes them); nothing here trains.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from common.durable import atomic_write_text

DIAGNOSTICS_FILE = "diagnostics.json"  # next to each run's result.json
# key, label, higher is better; the imagenet_* tasks are scripts.paper_imagenet's
METRIC = {"deit": ("top1", "Top-1 %", True), "dit": ("fid", "FID (fmnist-cnn)", False),
          "imagenet_deit": ("top1", "Top-1 % (ImageNet val)", True),
          "imagenet_dit": ("fid", "FID-50K (ADM reference)", False)}
TITLES = {"imagenet_deit": "ImageNet DeiT", "imagenet_dit": "ImageNet DiT"}


def _mean_std(values: Sequence[float]) -> tuple:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _fmt(mean, std, n: int = 2, digits: int = 2) -> str:
    """``mean ± std``; one value has no spread to show, so it says so instead of ``± 0.00``."""
    if mean is None:
        return "--"
    return f"{mean:.{digits}f} (1 seed)" if n == 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def summarize(results: Sequence[dict], metric: str) -> Dict[tuple, dict]:
    """Per (depth, lr, topology): metric mean/std over the seeds that did not diverge, and the diverged count."""
    groups: Dict[tuple, list] = {}
    for r in results:
        groups.setdefault((r["depth"], r["lr"], r["topology"]), []).append(r)
    out = {}
    for key, runs in groups.items():
        ok = [r for r in runs if not r["divergence"]["diverged"] and r.get(metric) is not None]
        values = [r[metric] for r in ok]
        mean, std = _mean_std(values)
        finals = [r["loss_curve"][-1][1] for r in runs if r["loss_curve"] and math.isfinite(r["loss_curve"][-1][1])]
        out[key] = {"mean": mean, "std": std, "n": len(values), "runs": len(runs),
                    "diverged": sum(r["divergence"]["diverged"] for r in runs),
                    "final_loss": _mean_std(finals)[0], "values": values,
                    "by_seed": {r["seed"]: r.get(metric) for r in ok}}
    return out


def paired_differences(summary: Dict[tuple, dict], topology: str, baseline: str = "pre") -> Dict[tuple, tuple]:
    """Per (depth, lr): mean and std over seeds of ``metric(topology) - metric(baseline)`` for the same seed."""
    out = {}
    for (depth, lr, topo), s in summary.items():
        base = summary.get((depth, lr, baseline))
        if topo != topology or base is None:
            continue
        diffs = [v - base["by_seed"][seed] for seed, v in s["by_seed"].items() if seed in base["by_seed"]]
        if diffs:
            out[(depth, lr)] = (*_mean_std(diffs), len(diffs))
    return out


def add_reused(summary: Dict[tuple, dict], reused: Dict[tuple, Dict[int, float]]) -> None:
    """Merge per-seed values of another study's runs (``{(depth, lr, topology): {seed: value}}``) into ``summary``
    for the seeds this comparison did not train itself; ``reused`` counts them."""
    for key, by_seed in reused.items():
        s = summary.setdefault(key, {"runs": 0, "diverged": 0, "final_loss": None, "by_seed": {}})
        added = {seed: v for seed, v in by_seed.items() if seed not in s["by_seed"]}
        s["by_seed"] = dict(sorted({**s["by_seed"], **added}.items()))
        s["values"] = list(s["by_seed"].values())
        s["mean"], s["std"] = _mean_std(s["values"])
        s["n"], s["runs"], s["reused"] = len(s["values"]), s["runs"] + len(added), len(added)


def verdicts(summary: Dict[tuple, dict], baselines: Sequence[str], higher: bool) -> List[str]:
    """Every other topology against each baseline, per depth and lr: the mean paired difference (same seed), its 95%
    Student-t interval, and the verdict: better or worse when the interval excludes 0, else within noise."""
    lines = []
    for topo in sorted({t for _, _, t in summary} - set(baselines)):
        for base in baselines:
            for (depth, lr), (mean, std, n) in sorted(paired_differences(summary, topo, base).items()):
                if n < 2:
                    lines.append(f"{topo} - {base}, depth {depth}, lr {lr:g}: {mean:+.2f} (one seed) -> untested")
                    continue
                half = _t95(n - 1) * std / math.sqrt(n)
                verdict = interval_verdict(mean, half, higher, BETTER)
                lines.append(f"{topo} - {base}, depth {depth}, lr {lr:g}: {mean:+.2f}, 95% interval "
                             f"[{mean - half:+.2f}, {mean + half:+.2f}] over {n} seeds -> **{verdict}**")
    return lines


BETTER, SUPPORTED = ("better", "worse"), ("supported", "contradicted")  # a comparison's words, a claim's words


def interval_verdict(mean: float, half: float, higher: bool, words=SUPPORTED) -> str:
    """The one rule of every verdict: the 95% interval ``mean +- half`` of a difference lies on the better side of 0
    (``words[0]``), on the worse side (``words[1]``), or holds 0 (within noise); ``higher``: larger is better."""
    gain = mean if higher else -mean
    return words[0] if gain > half else words[1] if gain < -half else "within noise"


def _t95(df: int) -> float:
    """Two-sided 95% Student-t quantile: with 2 or 3 seeds the interval is wide, as it should be."""
    from scipy.stats import t

    return float(t.ppf(0.975, df))


def claim_checks(summary: Dict[tuple, dict], task: str) -> List[str]:
    """The paper's four claims, each judged from this comparison's numbers by a stated rule."""
    metric, label, higher = METRIC[task]
    sign = 1.0 if higher else -1.0
    if not summary:
        return ["none judged: no finished run yet"]
    diffs = paired_differences(summary, "siamese")
    lines = []

    def margin_verdict(d):
        mean, std, n = d
        gain = sign * mean
        if n < 2:
            return f"{gain:+.2f} (one seed: no noise estimate)", "untested"
        half = _t95(n - 1) * std / math.sqrt(n)
        text = f"{gain:+.2f}, 95% interval ±{half:.2f} over {n} seeds"
        return text, interval_verdict(mean, half, higher)

    main_claim = "accuracy up (Top-1)" if higher else "FID down"
    other_claim = "FID down" if higher else "accuracy up (Top-1)"
    lowest_lr = min((lr for _, lr, _ in summary), default=None)
    parts = []
    for (depth, lr), d in sorted(diffs.items()):
        if summary.get((depth, lr, "pre"), {}).get("n") and lr == lowest_lr:
            text, verdict = margin_verdict(d)
            parts.append(f"depth {depth}, lr {lr:g}: Siamese - Pre-Norm improvement {text} -> {verdict}")
    lines.append(f"**{main_claim}** (rule: the 95% t-interval of the mean paired "
                 f"improvement of SiameseNorm over Pre-Norm, same seed, at the lowest lr lies above 0): " + ("; ".join(parts) or "not tested (no Pre/Siamese pair)"))
    lines.append(f"**{other_claim}**: not tested by a {task} comparison (run the other --task).")

    highest_lr = max((lr for _, lr, _ in summary), default=None)
    stab = []
    for (depth, lr, topo), s in sorted(summary.items()):
        if lr == highest_lr and topo in ("post", "siamese", "pre"):
            stab.append((depth, topo, s))
    post_bad = any(t == "post" and s["diverged"] for _, t, s in stab)
    siam_bad = any(t == "siamese" and s["diverged"] for _, t, s in stab)
    have_both = {t for _, t, _ in stab} >= {"post", "siamese"}
    desc = "; ".join(f"{t} d{d}: {s['diverged']}/{s['runs']} diverged" for d, t, s in stab)
    if not have_both or len({lr for _, lr, _ in summary}) < 2:
        verdict = "untested (needs Post-Norm and SiameseNorm at two learning rates)"
    elif post_bad and not siam_bad:
        verdict = "supported"
    elif siam_bad:
        verdict = "contradicted (SiameseNorm diverged)"
    else:
        verdict = "not shown (Post-Norm did not diverge at this lr)"
    lines.append(f"**stable at high lr where Post-Norm is not** (rule: at the highest lr {highest_lr:g}, Post-Norm "
                 f"diverges in some run and SiameseNorm in none): {desc or 'no runs'} -> {verdict}")

    depths = sorted({d for d, _ in diffs})
    if len(depths) < 2:
        lines.append("**larger margin when deeper**: untested (one depth).")
    else:
        parts = []
        for lr in sorted({lr for _, lr in diffs}):
            shallow, deep = diffs.get((depths[0], lr)), diffs.get((depths[-1], lr))
            if shallow and deep:
                gain = sign * (deep[0] - shallow[0])
                n = min(deep[2], shallow[2])
                if n < 2:
                    parts.append(f"lr {lr:g}: {gain:+.2f} (one seed: no noise estimate) -> untested")
                    continue
                half = _t95(n - 1) * math.sqrt((deep[1] ** 2 / deep[2]) + (shallow[1] ** 2 / shallow[2]))
                verdict = interval_verdict(deep[0] - shallow[0], half, higher)
                parts.append(f"lr {lr:g}: margin at depth {depths[-1]} minus margin at depth {depths[0]} = "
                             f"{gain:+.2f}, 95% interval ±{half:.2f} -> {verdict}")
        lines.append("**larger margin when deeper** (rule: the 95% interval of deeper margin minus shallower margin "
                     "lies above 0; df = fewest seeds - 1): "
                     + ("; ".join(parts) or "untested"))
    return lines


def mean_curve(curves: Sequence[Sequence[tuple]]) -> List[tuple]:
    """``[(step, mean loss)]`` over the runs that logged each step (non-finite values left out)."""
    by_step: Dict[int, list] = {}
    for curve in curves:
        for step, loss in curve:
            if math.isfinite(loss):
                by_step.setdefault(int(step), []).append(loss)
    return [(step, statistics.fmean(v)) for step, v in sorted(by_step.items())]


def loss_curves_figure(results: Sequence[dict]):
    """One panel per (depth, lr): every run as a thin line coloured by topology (common.plots), the mean over its
    seeds thick (non-finite points are gaps; a curve of one logged point is a dot with its value)."""
    from common.plots import TOPOLOGY_COLORS, plain_ticks, plot_series, pyplot

    settings = sorted({(r["depth"], r["lr"]) for r in results})
    fig, axes = pyplot().subplots(1, len(settings), figsize=(4.2 * len(settings), 3.4), squeeze=False)
    for ax, (depth, lr) in zip(axes[0], settings):
        runs = [r for r in results if (r["depth"], r["lr"]) == (depth, lr) and r["loss_curve"]]
        for topo in sorted({r["topology"] for r in runs}):
            mine = [r["loss_curve"] for r in runs if r["topology"] == topo]
            color = TOPOLOGY_COLORS.get(topo)
            for curve in mine:
                steps, losses = zip(*curve)
                plot_series(ax, steps, losses, color=color, lw=0.6, alpha=0.35, ms=3)
            mean = mean_curve(mine)
            if mean:
                steps, losses = zip(*mean)
                plot_series(ax, steps, losses, color=color, lw=1.8, ms=4,
                            label=f"{topo} (mean of {len(mine)})" if len(mine) > 1 else topo)
        ax.set_title(f"depth {depth}, lr {lr:g}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        plain_ticks(ax)
    fig.tight_layout()
    return fig


def plot_loss_curves(results: Sequence[dict], path: Path) -> None:
    from common.plots import pyplot

    fig = loss_curves_figure(results)
    fig.savefig(path, dpi=80)
    pyplot().close(fig)


def identical_value_notes(summary: Dict[tuple, dict], label: str, task: str) -> List[str]:
    """A note for each setting where every topology scored exactly the same: that is no tie, it means the
    evaluated weights do not differ (for DiT: an EMA still at the zero-initialised adaLN, whose output is 0 for
    any topology)."""
    notes = []
    for depth, lr in sorted({(d, lr) for d, lr, _ in summary}):
        means = {t: s["mean"] for (d, l2, t), s in summary.items() if (d, l2) == (depth, lr) and s["mean"] is not None}
        if len(means) > 1 and len(set(means.values())) == 1:
            why = (" the sampled EMA weights are still (close to) the zero-initialised DiT, which predicts the same for "
                   "every topology: train longer or lower --ema-decay" if task.endswith("dit") else
                   " the evaluated weights give the same predictions")
            notes.append(f"\nNote: at depth {depth}, lr {lr:g} every topology has the same {label} "
                         f"({next(iter(means.values())):.4f}), exactly:{why}.")
    return notes


def training_speed(run_dir: Path) -> Optional[float]:
    """The median logged ``train/steps_per_s`` of a run, or None without metrics."""
    from common.logging import read_metrics

    if not (run_dir / "metrics.jsonl").is_file():
        return None
    speeds = [float(r["train/steps_per_s"]) for r in read_metrics(run_dir) if "train/steps_per_s" in r]
    return statistics.median(speeds) if speeds else None


def write_diagnostic_plots(results: Sequence[dict], runs_dir: Path, report_dir: Path) -> List[tuple]:
    """For each (depth, lr): the diagnostics of the first seed of every topology, overlaid. Returns (setting, kind, png)."""
    from common.diagnostics import KINDS, write_diagnostic

    written = []
    if not results:
        return written
    first_seed = min(r["seed"] for r in results)
    for depth, lr in sorted({(r["depth"], r["lr"]) for r in results}):
        per_kind: Dict[str, dict] = {}
        for r in results:
            path = runs_dir / r["name"] / DIAGNOSTICS_FILE
            if (r["depth"], r["lr"], r["seed"]) != (depth, lr, first_seed) or not path.is_file():
                continue
            for kind, value in json.loads(path.read_text()).items():
                per_kind.setdefault(kind, {})[r["topology"]] = value
        sub = report_dir / f"diagnostics_d{depth}_lr{lr:g}"
        for kind in KINDS:
            if per_kind.get(kind):
                png = write_diagnostic(kind, per_kind[kind], sub, title=f"depth {depth}, lr {lr:g}, seed {first_seed}")
                written.append(((depth, lr), kind, png))
    return written


def interim_notice(pending: Sequence[str]) -> List[str]:
    """The lines after a report's first paragraph. A pre-registered study is judged on every run: while some are
    unfinished, the verdicts are a partial look, and the report says so."""
    if not pending:
        return [""]
    return ["", f"**Interim report: {len(pending)} of the study's runs unfinished.** Every verdict below is read "
            "from the seeds finished so far and is not the study's; the study's verdicts are this report's once no run "
            "is left.", ""]


def write_report(results: Sequence[dict], runs_dir: Path, report_dir: Path, task: str, pending: Sequence[str] = (),
                 command: str = "", notes: str = "", baselines: Sequence[str] = (),
                 reused: Optional[Dict[tuple, Dict[int, float]]] = None, reuse_note: str = "") -> Path:
    """``report_dir/report.md`` + ``loss_curves.png`` + per-setting diagnostic plots from finished runs.

    ``baselines``: every other topology is judged against each (:func:`verdicts`). ``reused``: per-seed values of
    another study's runs taken into the tables (:func:`add_reused`), ``reuse_note`` saying why they may be."""
    report_dir.mkdir(parents=True, exist_ok=True)
    metric, label, higher = METRIC[task]
    summary = summarize(results, metric)
    add_reused(summary, reused or {})
    lines = [f"# {TITLES.get(task, task.upper())} topology comparison", ""]
    if command:
        lines += ["Regenerate (finished runs under the same --out are reused; elsewhere, e.g. on a fresh clone, every run "
                  "is trained again):", "", f"    {command}", ""]
    lines += [f"{len(results)} finished runs" + (f", {len(pending)} unfinished: {', '.join(pending)}" if pending else "")
              + f". {label}: mean ± std over seeds that did not diverge ({'higher' if higher else 'lower'} is better); "
              "`n` = seeds counted / runs."] + interim_notice(pending)
    lines += [f"| depth | lr | topology | {label} | n | diverged | final train loss |", "|---|---|---|---|---|---|---|"]
    for (depth, lr, topo), s in sorted(summary.items()):
        final = f"{s['final_loss']:.3f}" if s["final_loss"] is not None else "--"
        lines.append(f"| {depth} | {lr:g} | {topo} | {_fmt(s['mean'], s['std'], s['n'])} | {s['n']}/{s['runs']} | "
                     f"{s['diverged']} | {final} |")
    if reuse_note:
        lines += ["", reuse_note]
    lines += identical_value_notes(summary, label, task)
    if baselines:
        lines += ["", f"## Verdicts against {', '.join(baselines)}", "",
                  f"Rule: the 95% Student-t interval of the mean paired difference in {label} (same seed) lies "
                  f"{'above' if higher else 'below'} 0 -> better, {'below' if higher else 'above'} 0 -> worse, "
                  "else within noise.", ""]
        lines += [f"- {v}" for v in verdicts(summary, baselines, higher)] or ["- none yet: no pair finished"]
    for topo in sorted({t for _, _, t in summary} - {"pre"}):
        diffs = paired_differences(summary, topo)
        if diffs:
            lines += ["", f"Paired difference {topo} - pre (same seed), {label}: mean ± std over seeds (the 95% "
                      "intervals are in the claims below):", ""]
            lines += [f"- depth {d}, lr {lr:g}: {_fmt(m, s, n)} over {n} seed(s)" for (d, lr), (m, s, n) in sorted(diffs.items())]
    lines += ["", "## Diverged runs", ""]
    diverged = [r for r in results if r["divergence"]["diverged"]]
    if diverged:
        lines += ["| run | step | reason |", "|---|---|---|"]
        lines += [f"| {r['name']} | {r['divergence']['step']} | {r['divergence']['reason']} |" for r in diverged]
    else:
        lines.append("None (no non-finite loss, no run ended above its first logged loss).")
    lines += ["", "## The paper's claims against this data", ""] + [f"- {c}" for c in claim_checks(summary, task)]
    stds = sorted(s["std"] for s in summary.values() if s["n"] > 1)
    if stds:
        lines.append(f"- **seed noise**: the std of {label} over seeds, per depth/lr/topology, ranges "
                     f"{stds[0]:.2f} to {stds[-1]:.2f} (median {statistics.median(stds):.2f}).")
    if notes:
        lines += ["", "## Notes", "", notes.strip()]
    if results:
        plot_loss_curves(results, report_dir / "loss_curves.png")
        lines += ["", "## Loss curves", "", "Every run (thin) and the mean over seeds per topology (thick); single "
                  "logged points are drawn as dots.", "", "![training loss](loss_curves.png)", ""]
    written = write_diagnostic_plots(results, runs_dir, report_dir)
    if written:
        lines += ["## Diagnostics", "",
                  "First seed of each topology. Hidden-state norms: mean token L2 norm per layer and stream (paper "
                  "Fig. 2a). Layer removal: held-out loss increase when one block is skipped (Fig. 2c). Stream "
                  "contribution: mean |weight| of SiameseNorm's post_norm (X) vs pre_norm (Y) per sublayer and of the "
                  "output fusion (Fig. 6). Gradient norm: the trainer's logged global grad norm, window means "
                  "(sec. 5.1). Numbers in the JSON next to each PNG.", ""]
        for (depth, lr), kind, png in written:
            lines.append(f"![{kind} depth {depth} lr {lr:g}]({png.relative_to(report_dir).as_posix()})")
    lines += ["", "## Per run", "", "`steps/s`: the median of the trainer's logged training speed (steps per second, "
              "data loading included). `wall s`: training, evaluation and sampling in the invocation that finished the "
              "run (a resumed run counts only its last part).", "",
              f"| run | {label} | steps | diverged at | steps/s | wall s |", "|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: r["name"]):
        value, speed = r.get(metric), training_speed(runs_dir / r["name"])
        lines.append(f"| {r['name']} | {'--' if value is None else f'{value:.2f}'} | {r.get('steps', '--')} | "
                     f"{r['divergence']['step'] if r['divergence']['diverged'] else '--'} | "
                     f"{'--' if speed is None else f'{speed:.2f}'} | {r.get('train_wall_s', '--')} |")
    path = report_dir / "report.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    atomic_write_text(report_dir / "summary.json", json.dumps(
        [{"depth": d, "lr": lr, "topology": t, "seeds": sorted(s["by_seed"]),
          **{k: v for k, v in s.items() if k != "by_seed"}}
         for (d, lr, t), s in sorted(summary.items())], indent=1))
    return path


def mean_interval(diffs: Sequence[float]) -> tuple:
    """The mean of paired differences and the half-width of its 95% Student-t interval (two or more seeds)."""
    mean, std = _mean_std(diffs)
    return mean, _t95(len(diffs) - 1) * std / math.sqrt(len(diffs))


def _verdict(diffs: Sequence[float], higher: bool) -> str:
    """The pre-registered rule on paired differences (SiameseNorm - Pre-Norm): the 95% t-interval of their mean
    lies on the better side of 0 -> supported, on the worse side -> contradicted, else within noise."""
    if len(diffs) < 2:
        return f"{statistics.fmean(diffs):+.2f} (one seed: no noise estimate) -> untested" if diffs else "untested"
    mean, half = mean_interval(diffs)
    return f"{mean:+.2f}, 95% interval ±{half:.2f} over {len(diffs)} seeds -> {interval_verdict(mean, half, higher)}"


def _paired(by_seed: Dict[int, float], base: Dict[int, float]) -> List[float]:
    return [v - base[s] for s, v in sorted(by_seed.items()) if s in base]


def recorded_differences(summary_file: Path, topology: str, baseline: str = "pre") -> Dict[tuple, List[float]]:
    """Per (depth, lr): the differences metric(topology) - metric(baseline) of a report's ``summary.json``, paired by
    seed (its ``seeds``; a summary without them lists every run's value by ascending seed)."""
    by_seed = {}
    for row in json.loads(Path(summary_file).read_text()):
        seeds = row.get("seeds")
        if seeds is None and row["n"] != row["runs"]:
            raise ValueError(f"{summary_file}: {row['topology']} depth {row['depth']} lacks seeds for some runs")
        by_seed[(row["depth"], row["lr"], row["topology"])] = dict(zip(seeds or range(row["n"]), row["values"]))
    return {(depth, lr): _paired(values, by_seed[(depth, lr, baseline)])
            for (depth, lr, topo), values in by_seed.items() if topo == topology and (depth, lr, baseline) in by_seed}


def plot_distance_curves(results: Sequence[dict], path: Path) -> None:
    """The in-training distance against the step: every run thin, the mean over seeds thick, one line style per
    objective and one colour per topology."""
    from common.plots import TOPOLOGY_COLORS, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    styles = ["-", "--", ":", "-."]
    objectives = list(dict.fromkeys(r.get("objective", "ddpm") for r in results))
    for style, objective in zip(styles * 4, objectives):
        for topo in sorted({r["topology"] for r in results}):
            curves = [r["fid_curve"] for r in results if r.get("fid_curve") and r["topology"] == topo
                      and r.get("objective", "ddpm") == objective]
            for curve in curves:
                ax.plot(*zip(*curve), lw=0.5, alpha=0.3, ls=style, color=TOPOLOGY_COLORS.get(topo))
            mean = mean_curve(curves)
            if mean:
                ax.plot(*zip(*mean), lw=1.8, ls=style, marker="o", ms=3, color=TOPOLOGY_COLORS.get(topo),
                        label=f"{objective} {topo} (mean of {len(curves)})")
    ax.set_xlabel("training step")
    ax.set_ylabel("Frechet distance (fmnist-cnn)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_objectives_report(results: Sequence[dict], report_dir: Path, objectives: Sequence[str],
                            pending: Sequence[str] = (), command: str = "", notes: str = "",
                            reproduces: Optional[Dict[str, Path]] = None) -> Path:
    """``report_dir/report.md`` of a DiT study over several objectives (each also has ``report_dir/<objective>/``):
    the final distance per objective and topology, SiameseNorm - Pre-Norm per objective by the pre-registered rule,
    the distance at the fixed steps the runs logged, and the runs that re-train an earlier study's (``reproduces``:
    objective -> that study's summary.json, whose ``values`` are per seed 0, 1, ...)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    metric, label, higher = METRIC["dit"]
    lines = ["# DiT objectives and topologies", ""]
    if command:
        lines += ["Regenerate (finished runs under the same --out are reused):", "", f"    {command}", ""]
    lines += [f"{len(results)} finished runs" + (f", {len(pending)} unfinished: {', '.join(pending)}" if pending else "")
              + f". {label} of the final EMA weights (lower is better): mean ± std over seeds; one report per objective: "
              + ", ".join(f"[{o}]({o}/report.md)" for o in objectives) + "."] + interim_notice(pending)
    groups: Dict[tuple, Dict[int, dict]] = {}
    for r in results:
        if not r["divergence"]["diverged"] and r.get(metric) is not None:
            groups.setdefault((r.get("objective", "ddpm"), r["topology"]), {})[r["seed"]] = r
    lines += [f"| objective | topology | {label} | n |", "|---|---|---|---|"]
    for (objective, topo), runs in sorted(groups.items(), key=lambda kv: (objectives.index(kv[0][0]), kv[0][1])):
        mean, std = _mean_std([r[metric] for r in runs.values()])
        lines.append(f"| {objective} | {topo} | {_fmt(mean, std, len(runs))} | {len(runs)} |")
    lines += ["", "## SiameseNorm - Pre-Norm, per objective", "",
              "Rule (pre-registered): the 95% Student-t interval of the mean paired difference (same seed) lies below "
              "0 -> *FID down* supported; above 0 -> contradicted; else within noise.", ""]
    for objective in objectives:
        siam = {s: r[metric] for s, r in groups.get((objective, "siamese"), {}).items()}
        pre = {s: r[metric] for s, r in groups.get((objective, "pre"), {}).items()}
        lines.append(f"- **{objective}**: {_verdict(_paired(siam, pre), higher)}")
    steps = sorted({s for r in results for s, _ in r.get("fid_curve", [])})
    if steps:
        lines += ["", "## The distance at fixed steps", "",
                  "The in-training Frechet distance (the run's EMA, its own sampler and steps, noise seeded by the run's "
                  "seed) at each logged step: mean ± std over seeds (n), and SiameseNorm - Pre-Norm paired by seed.", "",
                  "| objective | topology | " + " | ".join(f"step {s}" for s in steps) + " |",
                  "|---|---|" + "---|" * len(steps)]
        for (objective, topo), runs in sorted(groups.items(), key=lambda kv: (objectives.index(kv[0][0]), kv[0][1])):
            cells = []
            for step in steps:
                values = [dict(r.get("fid_curve", [])).get(step) for r in runs.values()]
                values = [v for v in values if v is not None and math.isfinite(v)]
                cells.append(f"{_fmt(*_mean_std(values), len(values))} ({len(values)})" if values else "--")
            lines.append(f"| {objective} | {topo} | " + " | ".join(cells) + " |")
        for objective in objectives:
            parts = []
            for step in steps:
                at = {t: {s: dict(r.get("fid_curve", [])).get(step) for s, r in groups.get((objective, t), {}).items()}
                      for t in ("siamese", "pre")}
                at = {t: {s: v for s, v in d.items() if v is not None} for t, d in at.items()}
                diffs = _paired(at["siamese"], at["pre"])
                if diffs:
                    parts.append(f"step {step}: {_verdict(diffs, higher)}")
            if parts:
                lines.append(f"- {objective}, SiameseNorm - Pre-Norm: " + "; ".join(parts))
        plot_distance_curves(results, report_dir / "distance_curves.png")
        lines += ["", "![distance at fixed steps](distance_curves.png)"]
    for objective, summary_file in (reproduces or {}).items():
        recorded = {row["topology"]: row["values"] for row in json.loads(Path(summary_file).read_text())}
        lines += ["", f"## {objective}: the re-trained runs against the recorded ones", "",
                  f"Recorded: `{summary_file.name}` of {summary_file.parent.name} (its values are seeds 0, 1, ...).", "",
                  "| topology | seed | recorded | re-trained | difference |", "|---|---|---|---|---|"]
        for topo in sorted(recorded):
            for seed, r in sorted(groups.get((objective, topo), {}).items()):
                if seed < len(recorded[topo]):
                    was = recorded[topo][seed]
                    lines.append(f"| {topo} | {seed} | {was:.6f} | {r[metric]:.6f} | {r[metric] - was:+.2e} |")
    if notes:
        lines += ["", "## Notes", "", notes.strip()]
    path = report_dir / "report.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    atomic_write_text(report_dir / "summary.json", json.dumps(
        [{"objective": o, "topology": t, "by_seed": {s: r[metric] for s, r in runs.items()},
          "fid_curves": {s: r.get("fid_curve") for s, r in runs.items()}} for (o, t), runs in sorted(groups.items())],
        indent=1))
    return path
