"""Compare residual topologies (Pre-Norm, Post-Norm, SiameseNorm, ...) over learning rates, depths and seeds.

    python -m scripts.compare --task deit --quick                       # 18 short runs, ~22 min on 2 CPU cores (21.5 measured)
    python -m scripts.compare --task deit                               # the full CPU preset: 36 runs, ~95 min
    python -m scripts.compare --task deit --data /data/my_imagefolder --topologies pre siamese --lrs 1e-3 --seeds 0 1
    python -m scripts.compare --task dit --quick --feature-weights ~/.cache/siamesenorm/fmnist_cnn.safetensors

Every run trains through the real trainer (``vision.train.train`` / ``diffusion.train.train``, starting from
``configs/fmnist_deit.yaml`` / ``configs/fmnist_dit.yaml``, or a study's ``config:``, e.g. ``fmnist_deit3.yaml``) in
``OUT/runs/<topology>_d<depth>_lr<lr>_s<seed>``,
is evaluated by the real evaluator (Top-1 of ``vision.evaluate`` on the held-out split; for DiT, samples from
``diffusion.sample`` scored by ``diffusion.fid`` with the Fashion-MNIST classifier features), and is diagnosed with
``common.diagnostics`` (``comparison.diagnose``). A finished run leaves ``result.json`` and is not redone; an unfinished one continues
from its last training checkpoint. A stop signal (SIGTERM, SIGUSR1) checkpoints the run in training and ends the
command with exit 4 before the next run starts. ``OUT/report.md`` (``--report`` elsewhere) gets: mean +- std over seeds,
paired differences to Pre-Norm, diverged runs (non-finite loss, or a loss that ends above its first logged
value) and the step it happened, loss curves, the diagnostic plots, and a check of the paper's four claims.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from common.cli import InputError, one_line_errors
from common.topologies import topology_names
from comparison.report import METRIC, write_objectives_report, write_report
from comparison.runs import (DEFAULT_OBJECTIVE, RESULT_FILE, TASKS, RunSpec, RunStopped, check_run_settings,
                             run_one)

ROOT = Path(__file__).resolve().parents[1]

PRESETS_FILE = ROOT / "configs" / "compare.yaml"  # the presets and the pre-registered studies, with their numbers


def _read_presets() -> tuple:
    import yaml

    data = yaml.safe_load(PRESETS_FILE.read_text())
    presets = {(name.split("_")[0], name.endswith("_quick")): values for name, values in data["presets"].items()}
    return presets, data["studies"]


PRESETS, STUDIES = _read_presets()


# ----------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m scripts.compare", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=list(STUDIES), help="a pre-registered study (docs/results/<study>/): its task, "
                   "settings and runs are fixed; only --out, --report, --notes, --threads, --feature-weights, "
                   "--encoder-weights, --shard apply")
    p.add_argument("--task", choices=list(TASKS), help="deit (default): classification Top-1; dit: generation FID")
    p.add_argument("--quick", action="store_true", help="the short 2-core preset (~22 min for DeiT; default: the full CPU preset)")
    p.add_argument("--data", default="fashion_mnist", help="fashion_mnist (default) or an ImageFolder root with train/ and val/")
    p.add_argument("--image-size", type=int, default=32, help="ImageFolder data: resize/crop size (patch = size/4)")
    p.add_argument("--topologies", nargs="+", help=f"DeiT: {' '.join(topology_names('deit'))}; "
                                                   f"DiT: {' '.join(topology_names('dit'))}")
    p.add_argument("--lrs", nargs="+", type=float, help="peak learning rates")
    p.add_argument("--depths", nargs="+", type=int, help="numbers of blocks")
    p.add_argument("--seeds", nargs="+", type=int, help="training seeds (data order, init, augmentation)")
    p.add_argument("--train-images", type=int, help="first N training images (0 = all)")
    p.add_argument("--val-images", type=int, help="DeiT: first N held-out images for Top-1 (0 = all)")
    p.add_argument("--diag-images", type=int, help="held-out images for the diagnostics")
    p.add_argument("--epochs", type=int, help="DeiT: passes over the training images")
    p.add_argument("--steps", type=int, help="DiT: optimizer steps")
    p.add_argument("--fid-samples", type=int, help="DiT: generated images per run for FID")
    p.add_argument("--sample-steps", type=int, help="DiT: respaced DDPM steps when sampling for FID")
    p.add_argument("--ema-decay", type=float, help="DiT: EMA decay of the sampled weights (keep 1/(1-decay) << steps)")
    p.add_argument("--feature-weights", help="DiT: fmnist-cnn weights (default: ~/.cache/siamesenorm/fmnist_cnn.safetensors)")
    p.add_argument("--encoder-weights", type=Path, help="a study whose objectives use REPA: the frozen encoder's "
                   "weights file (its preregistration says which)")
    p.add_argument("--log-every", type=int, help="logged loss points every N steps")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per training (default 1)")
    p.add_argument("--no-diagnostics", dest="diagnostics", action="store_false", help="skip the diagnostics")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="extra trainer overrides for every run (repeatable), e.g. optim.clip_grad=1.0 train.stop_at_step=50")
    p.add_argument("--out", type=Path, help="runs and report (default runs/compare_<task>[_quick])")
    p.add_argument("--report", type=Path, help="report directory (default: --out)")
    p.add_argument("--notes", type=Path, help="a markdown file whose text goes into the report under 'Notes'")
    p.add_argument("--report-only", action="store_true", help="train nothing: write the report of the runs finished "
                   "so far (the others are listed as unfinished), e.g. while other processes still train")
    p.add_argument("--shard", default="0/1", metavar="K/N", help="train only runs K, K+N, K+2N, ... (0-based) of the "
                   "list, e.g. on two machines; the report covers every finished run of the list. On one machine, "
                   "start the same command N times instead: a run being trained by one process is skipped by the others")
    args = p.parse_args(argv)
    try:
        args.shard_index, args.shard_count = (int(v) for v in args.shard.split("/"))
        if not 0 <= args.shard_index < args.shard_count:
            raise ValueError
    except ValueError:
        p.error(f"--shard {args.shard}: expected K/N with 0 <= K < N, e.g. 0/2")
    args.grids, args.objectives, args.fid_every, args.reproduces, args.variants, args.config = (None,) * 6
    if args.study:
        study = dict(STUDIES[args.study])
        given = [k for k in study if k != "grids" and getattr(args, k, None) not in (None, False, [])]
        given += [k for k in ("topologies", "depths", "seeds") if getattr(args, k) is not None]
        if given or args.quick or args.set:
            p.error(f"--study {args.study} fixes its settings; drop "
                    + ", ".join("--" + k.replace("_", "-") for k in given + ["quick"] * args.quick + ["set"] * bool(args.set)))
        args.grids = study.pop("grids")
        for key, value in study.items():
            setattr(args, key, value)
        args.topologies = sorted({t for g in args.grids for t in g["topologies"]})
        args.depths = sorted({d for g in args.grids for d in g["depths"]})
        needs_encoder = any("{encoder}" in o for d in (args.objectives or {}).values() for o in d.get("set", []))
        if needs_encoder and not (args.encoder_weights and args.encoder_weights.is_file()):
            p.error(f"--study {args.study} trains REPA runs: give --encoder-weights FILE, the frozen encoder its "
                    f"preregistration names (docs/results/{args.study}/preregistration.md)")
        args.seeds = sorted({s for g in args.grids for s in g["seeds"]})
    args.task = args.task or "deit"
    for key, value in PRESETS[(args.task, args.quick)].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key in ("train_images", "val_images", "diag_images"):
        if getattr(args, key, None) == 0:
            setattr(args, key, None)
    args.out = args.out or ROOT / "runs" / f"compare_{args.task}{'_quick' if args.quick else ''}"
    args.report = args.report or args.out
    allowed = topology_names(args.task)
    bad = [t for t in args.topologies if (args.variants or {}).get(t, {}).get("topology", t) not in allowed]
    if bad:
        p.error(f"--topologies {' '.join(bad)}: unknown for --task {args.task}; choose from {', '.join(allowed)}")
    if args.notes and not args.notes.is_file():
        p.error(f"--notes {args.notes}: no such file")
    if any(lr <= 0 for lr in args.lrs) or any(d < 1 for d in args.depths):
        p.error("--lrs must be positive and --depths at least 1")
    if args.task == "dit":  # the Frechet distance needs the classifier: say so now, not after the first training
        from diffusion.evaluation.features import FeatureExtractorError, resolve_weights

        try:
            resolve_weights("fmnist-cnn", args.feature_weights)
        except FeatureExtractorError as err:
            p.error(str(err))
    return args


def main(argv=None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    opts = parse_args(argv)
    with one_line_errors():  # e.g. a data folder smaller than one batch: one line, not a traceback
        return _compare(opts, argv)


def run_specs(opts) -> List[RunSpec]:
    """The runs of a comparison: the full grid of the options, or the union of a study's grids (in order)."""
    grids = opts.grids or [dict(topologies=opts.topologies, depths=opts.depths, seeds=opts.seeds)]
    phase = {}  # a grid's ``phase`` (default 0) runs after every lower one
    for g in grids:
        for spec in (RunSpec(t, d, lr, s, o) for d in g["depths"] for lr in opts.lrs for t in g["topologies"]
                     for s in g["seeds"] for o in g.get("objectives", [DEFAULT_OBJECTIVE])):
            phase[spec] = min(phase.get(spec, g.get("phase", 0)), g.get("phase", 0))
    # Seed by seed: a comparison stopped part-way holds complete pairs for its first seeds at every setting.
    order = {t: i for i, t in enumerate(dict.fromkeys(t for g in grids for t in g["topologies"]))}
    objectives = {o: i for i, o in enumerate(dict.fromkeys(o for g in grids for o in g.get("objectives", [DEFAULT_OBJECTIVE])))}
    return sorted(phase, key=lambda r: (phase[r], r.seed, r.depth, r.lr, objectives[r.objective], order[r.topology]))


def _as_list(value) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]


def reused_runs(reuse: Optional[dict], results: Sequence[dict], opts) -> tuple:
    """A study's ``reuse: {study, topologies, check: {depth, seed}}`` (a study may list several, one per reused
    study): the per-seed results of those topologies from ``docs/results/<study>/summary.json``, at this study's
    depths and lrs, taken into the report only if this code, retraining the ``check`` runs, gets the same metric to
    four decimals (the old run folders are not kept, so the finished summary is what the retrained runs are checked
    against). Returns ``(values, note)``."""
    if not reuse:
        return None, ""
    metric = METRIC[opts.task][0]
    old = {(s["depth"], s["lr"], s["topology"]): s
           for s in json.loads((ROOT / "docs" / "results" / reuse["study"] / "summary.json").read_text())}
    grids = STUDIES[reuse["study"]]["grids"]
    values = {}
    for (depth, lr, topo), s in old.items():
        if topo in reuse["topologies"] and depth in opts.depths and lr in opts.lrs:
            seeds = sorted({seed for g in grids if topo in g["topologies"] and depth in g["depths"] for seed in g["seeds"]})
            if s["diverged"] or len(s["values"]) != len(seeds):
                raise InputError(f"{reuse['study']}: {topo} depth {depth} has diverged or missing seeds; its runs "
                                 "cannot be reused seed by seed")
            values[(depth, lr, topo)] = dict(zip(seeds, s["values"]))
    check = reuse["check"]
    checks = []
    for topo in reuse["topologies"]:
        mine = [r for r in results if (r["topology"], r["depth"], r["seed"]) == (topo, check["depth"], check["seed"])]
        theirs = values.get((check["depth"], opts.lrs[0], topo), {}).get(check["seed"])
        if not mine:
            return None, (f"The {', '.join(reuse['topologies'])} runs of {reuse['study']} are not reused yet: the check "
                          f"run {topo} depth {check['depth']} seed {check['seed']} is unfinished.")
        checks.append((topo, mine[0].get(metric), theirs))
    described = "; ".join(f"{t}: {a:.4f} retrained, {b:.4f} in {reuse['study']}" for t, a, b in checks)
    if any(a is None or b is None or round(a, 4) != round(b, 4) for _, a, b in checks):
        return None, (f"The {reuse['study']} runs are **not** reused: retrained with this code, the check runs differ "
                      f"({described}).")
    return values, (f"The {', '.join(reuse['topologies'])} values of the other seeds are {reuse['study']}'s runs "
                    f"(docs/results/{reuse['study']}/summary.json), reused because this code, retraining depth "
                    f"{check['depth']} seed {check['seed']}, gets the same {metric} to four decimals ({described}).")


def train_runs(specs: Sequence[RunSpec], runs_dir: Path, opts) -> None:
    """Every unfinished run of ``specs``, in turn. A stop signal (SIGTERM or SIGUSR1, as a scheduler sends before it
    kills a job) checkpoints the run in training and starts no further run: the command ends with exit 4, as a
    trainer does, and the same command continues. A signal that comes while a run is evaluated or diagnosed lets that
    run finish first."""
    from common.preemption import EXIT_PREEMPTED, STOP_SIGNALS, StopRequests

    stop = StopRequests(STOP_SIGNALS).install()  # the trainer's own handler takes over while a run trains
    try:
        for spec in specs:
            run_one(spec, runs_dir, opts)
            if stop.received:
                break
        stopped = signal.Signals(stop.received).name if stop.received else None
    except RunStopped as err:
        stopped = err.signal_name
    finally:
        stop.restore()
    if stopped:
        print(f"{stopped} received: the comparison stopped; run the same command to continue (exit {EXIT_PREEMPTED})",
              flush=True)
        raise SystemExit(EXIT_PREEMPTED)


def _compare(opts, argv) -> Path:
    import vision  # noqa: F401  (registers the DeiT topologies with timm)

    runs_dir = opts.out / "runs"
    specs = run_specs(opts)
    train_runs(specs[opts.shard_index::opts.shard_count] if not opts.report_only else [], runs_dir, opts)
    results, pending = [], []
    for spec in specs:  # every run of the list, whichever process (shard) trained it
        done = runs_dir / spec.name / RESULT_FILE
        check_run_settings(runs_dir / spec.name, opts, spec)
        (results.append(json.loads(done.read_text())) if done.is_file() else pending.append(spec.name))
    command = "python -m scripts.compare " + " ".join(a for a in argv if a != "--report-only")  # the command that trains
    notes = opts.notes.read_text() if opts.notes else ""
    reused, reuse_note = {}, []
    for reuse in _as_list(getattr(opts, "reuse", None)):  # one entry per study whose runs are reused
        values, note = reused_runs(reuse, results, opts)
        reused.update(values or {})
        reuse_note.append(note)
    reused, reuse_note = reused or None, " ".join(reuse_note)
    baselines = getattr(opts, "baselines", None) or ()
    objectives = list(dict.fromkeys(s.objective for s in specs))
    if len(objectives) == 1:
        path = write_report(results, runs_dir, opts.report, opts.task, pending, command, notes,
                            baselines=baselines, reused=reused, reuse_note=reuse_note)
    else:  # a report per objective, and one that sets them side by side
        for objective in objectives:
            write_report([r for r in results if r.get("objective", DEFAULT_OBJECTIVE) == objective], runs_dir,
                         opts.report / objective, opts.task,
                         [s.name for s in specs if s.objective == objective and s.name in pending], command,
                         baselines=baselines)
        reproduces = {k: ROOT / v for k, v in (opts.reproduces or {}).items()}
        path = write_objectives_report(results, opts.report, objectives, pending, command, notes, reproduces)
    print(f"\nwrote {path}" + (f" ({len(pending)} runs unfinished; rerun the same command to continue)" if pending else ""))
    return path


if __name__ == "__main__":
    main()
