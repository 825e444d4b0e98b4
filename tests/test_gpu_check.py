"""make gpu-check: a clear error without a GPU, the same code on tiny models on the CPU, and its figures unbiased."""
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from tests.refusals import refusal

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_stops_with_a_clear_message(tmp_path, capsys):
    line = refusal(gpu_check.main, ["--out", tmp_path / "x.json"], capsys)  # exit 2, one line, no traceback
    assert "make gpu-check measures a CUDA GPU, and this torch sees none" in line
    assert not (tmp_path / "x.json").exists()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny CPU run of every part but the compiled trainers (the CUDA-default test covers compile)."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    results = gpu_check.main(["--allow-cpu", "--tiny", "--only", "step_time", "host_syncs", "data_feed", "sampling",
                              "--budget-s", "1200", "--out", str(out)])
    return results, json.loads(out.read_text())


def test_tiny_run_on_the_cpu_writes_every_figure(tiny_run):
    results, written = tiny_run
    assert written.keys() == results.keys() >= {"step_time", "host_syncs", "data_feed", "sampling", "parts"}
    assert {p["status"] for p in results["parts"].values()} == {"done"}, results["parts"]
    for label, r in results["step_time"].items():
        if isinstance(r, dict) and "pre" in r:
            assert r["siamese/pre time"] > 0 and r["siamese/pre activations"] > 1.0, label
    assert results["data_feed"]["images_per_s"] > 0 and results["sampling"]["fid50k_minutes_one_gpu"] > 0
    assert "fp32" in results["sampling"]["model"]  # timed as diffusion.sample runs, not under bf16


def test_host_syncs_are_counted_per_step_after_the_warm_up(tiny_run):
    syncs = tiny_run[0]["host_syncs"]
    for label in ("vision.train (deit_small_siamese recipe)", "diffusion.train (dit_b2_siamese recipe)"):
        r = syncs[label]
        assert min(r["counted steps"]) > 2 and len(r["counted steps"]) >= 5, r["counted steps"]
        assert set(r["project host reads per step"].values()) == {0}, r["where"]
        left_out = r["left out (warm-up and logging steps)"]
        assert {1, 2} <= {int(s) for s in left_out} and any(v["logging"] for v in left_out.values())
    assert "left out" in syncs["how"]


def test_step_times_measure_each_variant_alone_with_the_trainers_optimizer():
    """Peak memory is a variant's own: in sequential mode the first variant is freed before the second is built,
    and each runs the trainer's fused AdamW."""
    import gc
    import weakref

    from benchmarks.step import time_train_steps

    refs, alive_at_build, fused = {}, {}, []

    def builder(name):
        def build():
            gc.collect()
            alive_at_build[name] = [k for k, ref in refs.items() if ref() is not None]
            model = torch.nn.Linear(4, 4)
            refs[name] = weakref.ref(model)
            return model
        return build

    def make_optimizer(model):
        optimizer = gpu_check.trainer_optimizer(model)
        fused.append(optimizer.defaults["fused"])
        return optimizer

    r = time_train_steps({"pre": builder("pre"), "siamese": builder("siamese")}, lambda: (torch.randn(2, 4),),
                         lambda model, batch: model(batch[0]).square().mean(), steps=1, warmup=0,
                         make_optimizer=make_optimizer, sequential=True)
    assert set(r) == {"pre", "siamese"} and alive_at_build == {"pre": [], "siamese": []}
    assert fused == [True, True]


def test_the_budget_skips_what_does_not_fit_and_says_so(tmp_path):
    out = tmp_path / "x.json"
    results = gpu_check.main(["--allow-cpu", "--tiny", "--only", "trainer", "sampling", "--budget-s", "1",
                              "--out", str(out)])
    assert results["parts"]["trainer"]["status"] == "skipped" and "budget" in results["parts"]["trainer"]["reason"]
    assert results["parts"]["sampling"]["status"] == "skipped"
    assert json.loads(out.read_text())["parts"] == results["parts"]


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(*args):
        raise ImportError("No module named 'diffusers'")

    monkeypatch.setattr(gpu_check, "sampling", broken)
    results = gpu_check.main(["--allow-cpu", "--tiny", "--only", "sampling", "data_feed",
                              "--out", str(tmp_path / "x.json")])
    assert results["parts"]["sampling"]["status"] == "failed" and "diffusers" in results["parts"]["sampling"]["reason"]
    assert results["parts"]["data_feed"]["status"] == "done" and results["data_feed"]["images_per_s"] > 0


class SteppedClock:
    """A clock the parts below move by the durations they declare (the plan's decisions, not the machine's speed)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_plan_skips_by_measured_durations_once_a_piece_has_run(tmp_path):
    clock, ran, saves = SteppedClock(), [], []
    plan = gpu_check.Plan(200, tiny=False, clock=clock)

    def part(name, seconds):
        def run():
            ran.append(name)
            clock.now += seconds
            return {"ran": name}
        return run

    jobs = {  # guesses: host_syncs 45 s, sampling 45 s, data_feed 30 s
        "a": ("host_syncs", False, part("a", 60)),   # fits its guess; measured 60
        "b": ("host_syncs", False, part("b", 90)),   # expected 60 (measured) <= 140 left; takes 90
        "c": ("host_syncs", False, part("c", 1)),    # expected 90 (the longest measured) > 50 left: skipped
        "d": ("sampling", False, part("d", 1)),      # never ran: 45 x (150 / 90 measured over guessed) = 75 > 50
        "e": ("data_feed", False, part("e", 10)),    # 30 x 150 / 90 = 50 <= 50: runs
    }
    results = {}
    gpu_check.run_parts(list(jobs), jobs, plan, results, lambda: saves.append(dict(results["parts"])))
    parts = results["parts"]
    assert ran == ["a", "b", "e"] and [parts[k]["status"] for k in "abcde"] == ["done"] * 2 + ["skipped"] * 2 + ["done"]
    assert parts["c"]["reason"] == "budget: needs about 90 s (measured), 50 s left"
    assert parts["d"]["reason"] == "budget: needs about 75 s (estimated), 50 s left"
    assert plan.measured == {"host_syncs": [60.0, 90.0], "data_feed": [10.0]}
    assert results["e"] == {"ran": "e"} and len(saves) == 5 and saves[-1] == parts  # written after every part


def test_a_part_still_running_at_the_budget_is_stopped_and_the_rest_skipped(tmp_path):
    """The budget holds whatever the guesses: the part running at its end is stopped (SIGALRM), recorded as
    stopped, and nothing starts after it."""
    import threading

    plan = gpu_check.Plan(10.0, tiny=False)  # stopped at 10 - 5 s of reserve; the watchdog would come 2.5 s later
    plan.record("data_feed", 0.01)  # measured short: it fits

    def never_ends():
        threading.Event().wait()

    jobs = {"quick": ("data_feed", False, lambda: {"done": True}), "stuck": ("data_feed", False, never_ends),
            "after": ("data_feed", False, lambda: {"done": True})}
    results, ended = {}, []
    gpu_check.run_parts(list(jobs), jobs, plan, results, lambda: None, end=ended.append)
    assert ended == []  # the signal stopped the part; the watchdog had nothing to do
    parts = results["parts"]
    assert parts["quick"]["status"] == "done" and results["quick"] == {"done": True}
    assert parts["stuck"]["status"] == "stopped" and "stopped after" in parts["stuck"]["reason"]
    assert parts["after"] == {"status": "skipped", "reason": "budget: spent (a part was stopped at the budget)"}
    assert "after" not in results and plan.spent and not plan.in_part
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the timer is disarmed after the parts


STUCK_IN_ONE_CALL = """
import json, signal, sys, threading
from pathlib import Path
from benchmarks import gpu_check

plan = gpu_check.Plan(8.0, tiny=False)  # the signal at 8 - 5 s of reserve, the watchdog at 5.5 s
plan.record("data_feed", 0.01)
results, out = {}, Path(sys.argv[1])

def inside_one_call():  # as a C call that does not return: the signal's Python handler never runs in it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    threading.Event().wait()

jobs = {"quick": ("data_feed", False, lambda: {"done": True}), "stuck": ("data_feed", False, inside_one_call),
        "after": ("data_feed", False, lambda: {"done": True})}
gpu_check.run_parts(list(jobs), jobs, plan, results, lambda: out.write_text(json.dumps(results)))
print("not reached")
"""


def test_a_part_inside_one_call_at_the_budget_ends_the_process_with_its_results_written(tmp_path):
    """Python cannot interrupt a long C call: the watchdog records the part as stopped, skips the rest, writes the
    results and ends the process (exit 0), in a process of its own."""
    done = subprocess.run([sys.executable, "-c", STUCK_IN_ONE_CALL, str(tmp_path / "r.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "not reached" not in done.stdout, done.stderr[-2000:]
    parts = json.loads((tmp_path / "r.json").read_text())["parts"]
    assert parts["quick"]["status"] == "done"
    assert parts["stuck"]["status"] == "stopped" and "still inside one call" in parts["stuck"]["reason"]
    assert parts["after"]["status"] == "skipped"


def test_peers_runs_the_rows_whose_checkouts_it_finds_on_this_device(tmp_path, monkeypatch):
    """The peers part hands benchmarks.vs_peers the device, the sizes and the checkouts it finds under --peers; the
    rows of a missing checkout are left out and named; vs_peers exiting (a refused argument) fails the part, not the
    check."""
    from benchmarks import vs_peers

    (tmp_path / "DiT").mkdir()
    (tmp_path / "DiT" / "sample.py").write_text("")
    seen = []

    def fake_main(argv):
        seen.append(argv)
        return [{"measure": "sampling", "peer": "DiT sample.py", "ratio": 1.0, "ours": 1.0, "theirs": 1.0,
                 "unit": "samples/s"}]

    monkeypatch.setattr(vs_peers, "main", fake_main)
    results = gpu_check.main(["--allow-cpu", "--tiny", "--only", "peers", "--peers", str(tmp_path),
                              "--out", str(tmp_path / "x.json")])
    argv = seen[0]
    assert argv[argv.index("--rows") + 1] == "sample,fid" and argv[argv.index("--device") + 1] == "cpu"
    assert argv[argv.index("--dit-repo") + 1] == str(tmp_path / "DiT") and "--timm-repo" not in argv
    assert results["parts"]["peers"]["status"] == "done" and results["peers"]["rows"][0]["measure"] == "sampling"
    assert any("fast-DiT" in m and "train_dit" in m for m in results["peers"]["not found"])

    def failing_main(argv):
        raise SystemExit("error: --rows speed: choose from ...")

    monkeypatch.setattr(vs_peers, "main", failing_main)
    results = gpu_check.main(["--allow-cpu", "--tiny", "--only", "peers", "--peers", str(tmp_path),
                              "--out", str(tmp_path / "y.json")])
    peers = results["parts"]["peers"]
    assert peers["status"] == "failed" and "--rows speed" in peers["reason"]


def test_the_compile_break_even_is_the_extra_warm_up_over_the_saving_per_step():
    eager = {"pre": {"median_ms": 100.0, "warmup_s": 1.0}, "siamese": {"median_ms": 100.0, "warmup_s": 1.0}}
    compiled = {"pre": {"median_ms": 80.0, "warmup_s": 41.0}, "siamese": {"median_ms": 120.0, "warmup_s": 41.0}}
    assert gpu_check.compile_break_even(eager, compiled) == {"pre": pytest.approx(2000.0), "siamese": float("inf")}


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--out", "--only", "--budget-s", "--sync-warmup", "--compiled-step-time", "--allow-cpu", "--tiny",
                 "--peers", "--peer-rounds"):
        assert flag in text, flag
