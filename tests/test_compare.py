"""scripts.compare: the report of tiny finished runs, divergence detection, resume of an interrupted comparison."""
import json
import math

import pytest

from comparison.runs import detect_divergence, loss_curve
from scripts.compare import main

# A micro-DeiT on 256 Fashion-MNIST images: 8 steps of batch 32, about a second per run on one thread.
TINY = ["--task", "deit", "--quick", "--depths", "2", "--train-images", "256", "--val-images", "100",
        "--diag-images", "50", "--log-every", "2", "--set", "model.kwargs.embed_dim=16", "model.kwargs.num_heads=2",
        "optim.batch_size=32", "data.num_workers=0", "train.ckpt_every=4"]


def rec(step, loss, nonfinite=0):
    return {"step": step, "train/loss": loss, "train/nonfinite_steps": nonfinite}


def test_detect_divergence_rules():
    assert detect_divergence([rec(5, 2.3), rec(10, 1.9), rec(15, 1.5)]) == {"diverged": False, "step": None, "reason": ""}
    assert detect_divergence([rec(5, 2.3), rec(10, "nan", 1), rec(15, 1.5, 1)])["step"] == 10
    assert detect_divergence([rec(5, 2.3), rec(10, 2.0, 2)])["step"] == 10  # a skipped non-finite gradient
    up = detect_divergence([rec(5, 2.3), rec(10, 2.5), rec(15, 2.0), rec(20, 2.4), rec(25, 3.0)])
    assert up["diverged"] and up["step"] == 20 and "above its start" in up["reason"]
    stopped = detect_divergence([rec(5, 2.3)], error="the loss was NaN/inf for 20 steps in a row\nmore")
    assert stopped["diverged"] and "run stopped" in stopped["reason"]
    assert loss_curve([{"step": 1, "x": 0}, rec(2, 1.0), rec(2, 0.5), rec(3, "inf")])[:2] == [(2, 0.5), (3, math.inf)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    notes = out / "notes.md"
    notes.write_text("Hand-written reading of the numbers.")
    report = main(TINY + ["--topologies", "pre", "siamese", "--lrs", "1e-3", "--seeds", "0", "--out", str(out),
                          "--notes", str(notes)])
    return out, report


@pytest.mark.fashion_mnist
def test_report_of_two_finished_runs(finished):
    out, report = finished
    text = report.read_text()
    results = {t: json.loads((out / "runs" / f"{t}_d2_lr0.001_s0" / "result.json").read_text()) for t in ("pre", "siamese")}
    for topo, r in results.items():
        final = json.loads((out / "runs" / r["name"] / "final_metrics.json").read_text())
        assert r["top1"] == final["val/top1"] and r["steps"] == 8 and not r["divergence"]["diverged"]
        assert f"| 2 | 0.001 | {topo} | {r['top1']:.2f} (1 seed) | 1/1 | 0 |" in text
    diff = results["siamese"]["top1"] - results["pre"]["top1"]
    assert f"- depth 2, lr 0.001: {diff:.2f} (1 seed) over 1 seed(s)" in text
    assert "## Notes\n\nHand-written reading of the numbers." in text
    assert "None (no non-finite loss" in text and "larger margin when deeper**: untested (one depth)" in text
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    for kind in ("hidden_state_norms", "layer_removal", "stream_contribution", "grad_norm"):
        assert f"(diagnostics_d2_lr0.001/{kind}.png)" in text
        data = json.loads((out / "diagnostics_d2_lr0.001" / f"{kind}.json").read_text())
        assert set(data) == ({"siamese"} if kind == "stream_contribution" else {"pre", "siamese"})
    norms = json.loads((out / "diagnostics_d2_lr0.001" / "hidden_state_norms.json").read_text())
    assert set(norms["siamese"]["norms"]) == {"x", "y"} and len(norms["pre"]["norms"]["h"]) == 3
    removal = json.loads((out / "diagnostics_d2_lr0.001" / "layer_removal.json").read_text())
    assert len(removal["pre"]["loss_increase"]) == 2 and "removed_top1" in removal["pre"]


@pytest.mark.fashion_mnist
def test_a_finished_run_made_with_other_settings_is_not_reused(finished):
    out, _ = finished
    args = [a if a != "256" else "128" for a in TINY]  # --train-images 128 instead of 256
    with pytest.raises(SystemExit, match="train_images: 256 then, 128 now") as exit_info:
        main(args + ["--topologies", "pre", "--lrs", "1e-3", "--seeds", "0", "--out", str(out)])
    assert exit_info.value.code == 2


@pytest.mark.fashion_mnist
def test_a_run_made_to_diverge_is_reported(tmp_path):
    # Post-Norm at lr 1e20 without warmup: the weights overflow within a few steps on any CPU (at lr 10 the loss
    # turned non-finite on some machines and only large on others).
    report = main(TINY + ["--topologies", "post", "--lrs", "1e20", "--seeds", "0", "--out", str(tmp_path),
                          "--set", "optim.warmup_epochs=0", "--log-every", "1"])
    result = json.loads((tmp_path / "runs" / "post_d2_lr1e+20_s0" / "result.json").read_text())
    div = result["divergence"]
    assert div["diverged"] and div["reason"].startswith("non-finite")
    assert 1 <= div["step"] <= 8
    assert f"| post_d2_lr1e+20_s0 | {div['step']} | non-finite" in report.read_text()
    assert "| 2 | 1e+20 | post | -- | 0/1 | 1 |" in report.read_text()  # a diverged run is not averaged


@pytest.mark.fashion_mnist
def test_an_interrupted_comparison_resumes(finished, tmp_path):
    done_out, _ = finished
    out = tmp_path
    # The finished pre run is copied in; the siamese run is interrupted at step 4 (as a time-limited slot would).
    import shutil

    shutil.copytree(done_out / "runs" / "pre_d2_lr0.001_s0", out / "runs" / "pre_d2_lr0.001_s0")
    done_file = out / "runs" / "pre_d2_lr0.001_s0" / "result.json"
    stamp = done_file.stat().st_mtime_ns
    args = TINY + ["--topologies", "pre", "siamese", "--lrs", "1e-3", "--seeds", "0", "--out", str(out)]
    report = main(args + ["--set", "train.stop_at_step=4"])
    siamese = out / "runs" / "siamese_d2_lr0.001_s0"
    assert not (siamese / "result.json").exists() and (siamese / "checkpoints" / "step_000000004.pt").exists()
    assert "1 unfinished: siamese_d2_lr0.001_s0" in report.read_text()

    report = main(args)
    assert done_file.stat().st_mtime_ns == stamp  # the finished run was not redone
    steps = [r["step"] for r in map(json.loads, (siamese / "metrics.jsonl").read_text().splitlines())]
    assert steps.count(0) == 1 and max(steps) == 8  # continued from step 4, not restarted
    resumed = json.loads((siamese / "result.json").read_text())
    uninterrupted = json.loads((done_out / "runs" / "siamese_d2_lr0.001_s0" / "result.json").read_text())
    assert resumed["top1"] == uninterrupted["top1"] and resumed["loss_curve"] == uninterrupted["loss_curve"]
    assert "2 finished runs." in report.read_text()


@pytest.mark.fashion_mnist
def test_a_stop_signal_ends_the_comparison_with_exit_4_and_the_same_command_continues(finished, tmp_path):
    """A real SIGTERM, as a scheduler sends before it kills the job: the run in training checkpoints, no further run
    starts, the command exits 4 (what train.sbatch requeues on); a signal after a run's last step lets that run
    finish (evaluation, result.json) and then stops the same way."""
    import subprocess
    import sys

    from common.train_state import CheckpointManager
    from scripts.compare import ROOT

    args = TINY + ["--topologies", "pre", "siamese", "--lrs", "1e-3", "--seeds", "0", "--out", str(tmp_path)]
    pre, siamese = tmp_path / "runs" / "pre_d2_lr0.001_s0", tmp_path / "runs" / "siamese_d2_lr0.001_s0"

    def signalled_at(nth):  # SIGTERM to itself after the process's nth optimizer step
        return subprocess.run([sys.executable, "-m", "tests.faults", "sigterm", str(nth), "--", "-m", "scripts.compare",
                               *args], cwd=ROOT, capture_output=True, text=True, timeout=600)

    first = signalled_at(3)  # between two log records (every 2 steps): the checkpoint carries step 3's sums
    assert first.returncode == 4, first.stderr[-3000:]
    assert "SIGTERM received: the comparison stopped; run the same command to continue (exit 4)" in first.stdout
    assert CheckpointManager(pre / "checkpoints").steps() == [3] and not (pre / "result.json").exists()
    assert not siamese.exists()  # the next run did not start

    second = signalled_at(5)  # pre resumes at step 3: its 5th step here is its last, where the run ignores a signal
    assert second.returncode == 4, second.stderr[-3000:]
    assert (pre / "result.json").exists() and not siamese.exists()

    report = main(args)  # the same command, left alone, finishes the comparison
    assert "2 finished runs." in report.read_text()
    for run in (pre, siamese):
        resumed = json.loads((run / "result.json").read_text())
        uninterrupted = json.loads((finished[0] / "runs" / run.name / "result.json").read_text())
        assert resumed["top1"] == uninterrupted["top1"] and resumed["loss_curve"] == uninterrupted["loss_curve"]
    assert [step for step, _ in resumed["loss_curve"]] == [2, 4, 6, 8]


@pytest.mark.fashion_mnist
@pytest.mark.filterwarnings("ignore:.*covariance is singular:UserWarning")  # 10 samples: the tiny run's own warning
def test_dit_comparison_scores_fid_through_sampler_and_fid(tmp_path):
    import torch

    from common.checkpoint import save_weights
    from diffusion.evaluation.features import FashionMNISTClassifier

    torch.manual_seed(0)
    weights = tmp_path / "fmnist_cnn.safetensors"
    save_weights(FashionMNISTClassifier(), weights)  # random features: the pipeline, not the quality, is tested
    report = main(["--task", "dit", "--quick", "--topologies", "siamese", "--lrs", "3e-4", "--depths", "2",
                   "--seeds", "0", "--train-images", "64", "--steps", "4", "--fid-samples", "10", "--sample-steps", "2",
                   "--diag-images", "4", "--log-every", "2", "--feature-weights", str(weights), "--out", str(tmp_path / "c"),
                   "--set", "optim.batch_size=8", "model.kwargs.hidden_size=24", "data.num_workers=0"])
    run = tmp_path / "c" / "runs" / "siamese_d2_lr0.0003_s0"
    result = json.loads((run / "result.json").read_text())
    assert result["fid"] == json.loads((run / "fid_samples" / "fid.json").read_text())["metrics"]["fid"] > 0
    assert f"| 2 | 0.0003 | siamese | {result['fid']:.2f} (1 seed) | 1/1 | 0 |" in report.read_text()
    diag = json.loads((run / "diagnostics.json").read_text())
    assert set(diag["hidden_state_norms"]["norms"]) == {"x", "y"} and len(diag["layer_removal"]["loss_increase"]) == 2
    from scripts.diagnose import main as diagnostics_main  # the command on the same DiT run gives the same numbers

    found = diagnostics_main(["--run", str(run), "--out", str(tmp_path / "d"), "--images", "4"])
    assert found["layer_removal"][run.name] == diag["layer_removal"]


@pytest.mark.fashion_mnist
def test_diagnostics_command_on_finished_runs_matches_the_comparison(finished, tmp_path, capsys):
    from scripts.diagnose import main as diagnostics_main

    out, _ = finished
    runs = [str(out / "runs" / f"{t}_d2_lr0.001_s0") for t in ("pre", "siamese")]
    capsys.readouterr()
    found = diagnostics_main(["--run", *runs, "--out", str(tmp_path), "--images", "50"])
    said = capsys.readouterr().out.splitlines()  # a line before each run, not silence until the plots
    assert said[0] == "diagnose: loading the libraries for 2 run(s)"
    assert said[1].startswith(f"diagnosing {runs[0]} (1 of 2; model.safetensors, held-out loss on 50 images): ")
    assert said[2].startswith(f"diagnosing {runs[1]} (2 of 2;")
    assert set(found["layer_removal"]) == {"pre_d2_lr0.001_s0", "siamese_d2_lr0.001_s0"}
    stored = json.loads((out / "runs" / "siamese_d2_lr0.001_s0" / "diagnostics.json").read_text())
    assert found["layer_removal"]["siamese_d2_lr0.001_s0"] == stored["layer_removal"]
    assert (tmp_path / "stream_contribution.png").is_file() and (tmp_path / "grad_norm.json").is_file()


def test_a_study_fixes_its_runs_and_settings():
    from scripts.compare import parse_args, run_specs

    opts = parse_args(["--study", "deit_depth"])
    specs = run_specs(opts)
    assert (opts.task, opts.epochs, opts.lrs, opts.train_images, opts.val_images) == ("deit", 3, [1e-3], None, None)
    assert len(specs) == 6 * 3 * 2 + 3  # pre and siamese at depths 6, 12, 24 over seeds 0-5; post at 24, seeds 0-2
    assert [s.name for s in specs[:7]] == ["pre_d6_lr0.001_s0", "siamese_d6_lr0.001_s0", "pre_d12_lr0.001_s0",
                                           "siamese_d12_lr0.001_s0", "pre_d24_lr0.001_s0", "siamese_d24_lr0.001_s0",
                                           "post_d24_lr0.001_s0"]  # seed by seed: a stopped study has whole pairs
    dit = parse_args(["--study", "dit_long", "--feature-weights", __file__])
    assert (dit.task, dit.steps, dit.fid_samples, dit.sample_steps, len(run_specs(dit))) == ("dit", 3000, 1000, 50, 12)
    flow = parse_args(["--study", "dit_flow", "--feature-weights", __file__, "--encoder-weights", __file__])
    names = [s.name for s in run_specs(flow)]
    assert len(names) == 36 and names[:6] == ["pre_d8_lr0.001_s0", "siamese_d8_lr0.001_s0", "flow_pre_d8_lr0.001_s0",
                                              "flow_siamese_d8_lr0.001_s0", "repa_pre_d8_lr0.001_s0",
                                              "repa_siamese_d8_lr0.001_s0"]  # the re-trained DDPM pair first
    assert names[-1] == "siamese_d8_lr0.001_s5" and (flow.fid_every, flow.steps) == (1000, 3000)
    with pytest.raises(SystemExit):  # its REPA runs need the frozen encoder
        parse_args(["--study", "dit_flow", "--feature-weights", __file__])
    for extra in (["--epochs", "1"], ["--seeds", "0"], ["--quick"], ["--set", "optim.batch_size=64"]):
        with pytest.raises(SystemExit):
            parse_args(["--study", "deit_depth", *extra])


@pytest.mark.fashion_mnist
def test_two_shards_train_disjoint_runs_and_one_report_covers_both(tmp_path):
    args = TINY + ["--topologies", "pre", "siamese", "--lrs", "1e-3", "--seeds", "0", "--out", str(tmp_path),
                   "--no-diagnostics"]
    first = main(args + ["--shard", "0/2"]).read_text()
    assert "1 finished runs, 1 unfinished: siamese_d2_lr0.001_s0" in first
    assert not (tmp_path / "runs" / "siamese_d2_lr0.001_s0").exists()
    so_far = main(args + ["--report-only"]).read_text()  # the report so far; nothing trained
    assert so_far == first.replace(" --shard 0/2", "")  # its command line is the one that trains, not --report-only
    assert not (tmp_path / "runs" / "siamese_d2_lr0.001_s0").exists()
    second = main(args + ["--shard", "1/2"]).read_text()
    assert "2 finished runs." in second and "| 2 | 0.001 | siamese |" in second


@pytest.mark.fashion_mnist
def test_a_run_claimed_by_another_process_is_skipped(tmp_path):
    from common.train_state import RunLock

    claim = RunLock(tmp_path / "runs" / ".claims" / "pre_d2_lr0.001_s0")
    claim.acquire()  # as a second `scripts.compare` process running that run holds it
    try:
        report = main(TINY + ["--topologies", "pre", "--lrs", "1e-3", "--seeds", "0", "--out", str(tmp_path),
                              "--no-diagnostics"]).read_text()
    finally:
        claim.release()
    assert "0 finished runs, 1 unfinished: pre_d2_lr0.001_s0" in report
    assert "**Interim report: 1 of the study's runs unfinished.** Every verdict below" in report
    assert not (tmp_path / "runs" / "pre_d2_lr0.001_s0").exists()


def test_a_report_of_one_point_curves_and_equal_scores_is_readable(tmp_path):
    """One logged point per run (the one-minute checks) must still draw; a tie to the last digit is explained."""
    import numpy as np
    from PIL import Image

    from comparison.report import mean_curve, write_report

    def result(topology, seed, curve, fid=812.5):
        return {"topology": topology, "depth": 2, "lr": 3e-4, "seed": seed, "name": f"{topology}_d2_lr0.0003_s{seed}",
                "fid": fid, "steps": 4, "divergence": {"diverged": False, "step": None, "reason": ""},
                "loss_curve": curve, "train_wall_s": 1.0}

    results = [result("pre", 0, [(4, 0.9)]), result("siamese", 0, [(4, 0.8)])]
    report = write_report(results, tmp_path / "runs", tmp_path, "dit").read_text()
    assert "every topology has the same FID (fmnist-cnn) (812.5000), exactly" in report and "zero-initialised" in report
    assert "812.50 (1 seed)" in report and "± 0.00" not in report and "Interim" not in report
    pixels = np.asarray(Image.open(tmp_path / "loss_curves.png").convert("RGB")).reshape(-1, 3).astype(int)
    blue = ((abs(pixels - [31, 119, 180]).sum(1)) < 60).sum()  # tab:blue, the Pre-Norm dot (legend swatch excluded)
    green = ((abs(pixels - [44, 160, 44]).sum(1)) < 60).sum()
    assert blue > 40 and green > 40, (blue, green)
    assert mean_curve([[(1, 2.0), (2, 1.0)], [(1, 4.0), (2, float("nan"))]]) == [(1, 3.0), (2, 1.0)]


TINY_OBJECTIVES = {  # a study over two objectives, shrunk: DDPM first (phase 0), then SiT's flow matching
    "task": "dit", "lrs": [2e-3], "train_images": 64, "steps": 6, "ema_decay": 0.5, "fid_samples": 10,
    "sample_steps": 2, "diag_images": 4, "log_every": 2, "fid_every": 3,
    "set": ["optim.batch_size=8", "model.kwargs.hidden_size=24", "data.num_workers=0"],
    "objectives": {"flow": {"config": "fmnist_sit.yaml", "sampler": "euler", "sample_steps": 3}},
    "grids": [{"objectives": ["flow"], "topologies": ["pre", "siamese"], "depths": [2], "seeds": [0], "phase": 1},
              {"topologies": ["pre", "siamese"], "depths": [2], "seeds": [0]}]}


@pytest.mark.fashion_mnist
def test_a_study_over_two_objectives_logs_the_distance_at_fixed_steps(tmp_path, monkeypatch):
    import torch

    from common.checkpoint import save_weights
    from common.logging import read_metrics
    from comparison.report import write_objectives_report
    from diffusion.evaluation.features import FashionMNISTClassifier
    from scripts import compare

    torch.manual_seed(0)
    weights = tmp_path / "fmnist_cnn.safetensors"
    save_weights(FashionMNISTClassifier(), weights)
    monkeypatch.setitem(compare.STUDIES, "tiny_objectives", TINY_OBJECTIVES)
    specs = compare.run_specs(compare.parse_args(["--study", "tiny_objectives", "--feature-weights", str(weights)]))
    assert [s.name for s in specs] == ["pre_d2_lr0.002_s0", "siamese_d2_lr0.002_s0", "flow_pre_d2_lr0.002_s0",
                                       "flow_siamese_d2_lr0.002_s0"]  # phase 0 before phase 1
    with pytest.warns(UserWarning, match="covariance is singular"):
        report = main(["--study", "tiny_objectives", "--feature-weights", str(weights), "--out", str(tmp_path / "c"),
                       "--no-diagnostics"])
    flow = tmp_path / "c" / "runs" / "flow_siamese_d2_lr0.002_s0"
    result = json.loads((flow / "result.json").read_text())
    logged = [(r["step"], r["fid/fd"], r["fid/steps"]) for r in read_metrics(flow) if "fid/fd" in r]
    assert [(s, fd) for s, fd, _ in logged] == [tuple(p) for p in result["fid_curve"]] and len(logged) == 2
    assert all(steps == 3 for _, _, steps in logged)  # the objective's own steps
    protocol = json.loads((flow / "fid_samples" / "protocol.json").read_text())
    assert protocol["sampler"] == "euler" and result["fid"] == json.loads(
        (flow / "fid_samples" / "fid.json").read_text())["metrics"]["fid"]
    ddpm = json.loads((tmp_path / "c" / "runs" / "pre_d2_lr0.002_s0" / "result.json").read_text())
    assert ddpm["objective"] == "ddpm" and len(ddpm["fid_curve"]) == 2
    text = report.read_text()
    assert "Interim" not in text and "Interim" in write_objectives_report([], tmp_path / "r", ["ddpm"], ["a"]).read_text()
    assert "[ddpm](ddpm/report.md), [flow](flow/report.md)" in text and "| flow | siamese |" in text
    assert "- **flow**: " in text and "| step 3 | step 6 |" in text
    assert (tmp_path / "c" / "flow" / "report.md").is_file() and (tmp_path / "c" / "distance_curves.png").is_file()


def test_a_study_reuses_another_studys_runs_only_when_its_retrained_pair_matches(tmp_path):
    """deit_hc_attnres takes deit_depth's Pre-Norm and SiameseNorm seeds when this code, retraining depth 12 seed 0,
    gets their Top-1; otherwise, or before the pair has run, none."""
    from scripts.compare import ROOT, parse_args, reused_runs

    opts = parse_args(["--study", "deit_hc_attnres", "--out", str(tmp_path)])
    old = {(s["topology"], s["depth"]): s["values"]
           for s in json.loads((ROOT / "docs/results/deit_depth/summary.json").read_text())}
    pair = [{"topology": t, "depth": 12, "seed": 0, "top1": old[(t, 12)][0]} for t in ("pre", "siamese")]
    values, note = reused_runs(opts.reuse, pair, opts)
    assert values[(24, 1e-3, "siamese")] == dict(enumerate(old[("siamese", 24)]))
    assert set(values) == {(d, 1e-3, t) for d in (12, 24) for t in ("pre", "siamese")}
    assert "reused because this code, retraining depth 12 seed 0, gets the same top1" in note
    pair[1]["top1"] += 0.01
    values, note = reused_runs(opts.reuse, pair, opts)
    assert values is None and "**not** reused" in note
    values, note = reused_runs(opts.reuse, pair[:1], opts)
    assert values is None and "siamese depth 12 seed 0 is unfinished" in note


def test_routing_studies_train_variants_and_reuse_two_studies(tmp_path):
    """dit_routing's variants are a topology with options (recorded with the run, so a run made with others is not
    reused); deit_attnres takes deit_depth's Pre-Norm and SiameseNorm and deit_hc_attnres's Block AttnRes, each
    only when its own retrained check run matches."""
    from common.config import load_config
    from comparison.runs import check_run_settings, topology_settings
    from diffusion.train import TrainConfig
    from scripts.compare import ROOT, parse_args, reused_runs, run_specs

    opts = parse_args(["--study", "dit_routing", "--feature-weights", __file__, "--out", str(tmp_path)])
    specs = run_specs(opts)
    assert len(specs) == 3 + 4 * 6 + 3 * 5 and [s.topology for s in specs[:7]] == [
        "pre", "siamese", "attnres", "attnres_block", "dar_t", "dar_dynamic", "siamese_dar"]
    dynamic = specs[5]
    topology, overrides = topology_settings(dynamic, opts)
    assert (topology, overrides) == ("dar", ["model.kwargs.dar_query=dynamic", "model.kwargs.dar_chunk=4"])
    assert check_run_settings(tmp_path / dynamic.name, opts, dynamic)["variant"]["topology"] == "dar"
    cfg = load_config(TrainConfig, ROOT / "configs" / "fmnist_dit.yaml", [f"model.topology={topology}", *overrides])
    assert cfg.model.kwargs["dar_query"] == "dynamic"
    deit = parse_args(["--study", "deit_attnres", "--out", str(tmp_path)])
    old = {(s["study"], s["topology"]): s["values"] for study in ("deit_depth", "deit_hc_attnres")
           for s in [dict(r, study=study) for r in json.loads((ROOT / f"docs/results/{study}/summary.json").read_text())
                     if r["depth"] == 12]}
    checks = [{"topology": t, "depth": 12, "seed": 0, "top1": old[(study, t)][0]}
              for study, t in (("deit_depth", "pre"), ("deit_depth", "siamese"), ("deit_hc_attnres", "attnres_block"))]
    found = [reused_runs(reuse, checks, deit) for reuse in deit.reuse]
    assert set(found[0][0]) == {(d, 1e-3, t) for d in (12, 24) for t in ("pre", "siamese")}
    assert set(found[1][0]) == {(d, 1e-3, "attnres_block") for d in (12, 24)}
    checks[2]["top1"] += 0.01
    assert reused_runs(deit.reuse[1], checks, deit)[0] is None


def test_the_deit3_study_trains_every_run_on_its_own_recipe(tmp_path, monkeypatch):
    """deit3_depth's ``config:`` is the recipe of its runs (DeiT III's on the micro-DeiT), recorded with each run so that
    a run made from another recipe is not reused; the study's topology, depth, lr and seed still come on top."""
    import vision.train
    from comparison.runs import check_run_settings, train_deit
    from scripts.compare import parse_args, run_specs

    opts = parse_args(["--study", "deit3_depth", "--out", str(tmp_path)])
    specs = run_specs(opts)
    assert len(specs) == 6 * 2 * 2 + 3 and (opts.config, opts.lrs, opts.epochs) == ("fmnist_deit3.yaml", [4e-3], 3)
    assert [s.name for s in specs[:5]] == ["pre_d12_lr0.004_s0", "siamese_d12_lr0.004_s0", "pre_d24_lr0.004_s0",
                                           "siamese_d24_lr0.004_s0", "post_d24_lr0.004_s0"]
    assert check_run_settings(tmp_path / specs[1].name, opts, specs[1])["config"] == "fmnist_deit3.yaml"
    assert "config" not in check_run_settings(tmp_path / "x", parse_args(["--study", "deit_depth"]))  # as before
    trained = []
    monkeypatch.setattr(vision.train, "train", lambda cfg: trained.append(cfg) or {"stopped_at": 1})
    train_deit(specs[3], tmp_path / specs[3].name, opts)
    cfg = trained[0]
    assert (cfg.model.name, cfg.model.kwargs["depth"], cfg.model.kwargs["init_values"], cfg.optim.lr,
            cfg.optim.optimizer, cfg.augment.bce_loss, cfg.augment.three_augment, cfg.train.seed) == \
           ("deit_tiny_siamese_patch16_224", 24, 1e-4, 4e-3, "lamb", True, True, 0)


def test_verdicts_against_each_baseline_with_their_95_intervals():
    from comparison.report import add_reused, summarize, verdicts

    def run(topology, seed, top1):
        return {"topology": topology, "depth": 12, "lr": 1e-3, "seed": seed, "top1": top1,
                "divergence": {"diverged": False}, "loss_curve": []}

    results = [run("hc", s, 81 + 0.1 * s + (0.05 if s % 2 else -0.05)) for s in range(6)] + [run("pre", 0, 80.0)]
    summary = summarize(results, "top1")
    add_reused(summary, {(12, 1e-3, "pre"): {s: 80 + 0.1 * s for s in range(6)},
                         (12, 1e-3, "siamese"): {s: 81 + 0.1 * s for s in range(6)}})
    assert summary[(12, 1e-3, "pre")]["n"] == 6 and summary[(12, 1e-3, "pre")]["reused"] == 5
    lines = verdicts(summary, ["pre", "siamese"], higher=True)
    # hc - pre: 1 +- 0.05 alternating, std 0.0548, t(5) 2.571: half-width 0.0575
    assert lines[0] == "hc - pre, depth 12, lr 0.001: +1.00, 95% interval [+0.94, +1.06] over 6 seeds -> **better**"
    assert lines[1] == "hc - siamese, depth 12, lr 0.001: +0.00, 95% interval [-0.06, +0.06] over 6 seeds -> **within noise**"
    assert verdicts(summary, ["pre"], higher=False)[0].endswith("-> **worse**")  # FID: lower is better
