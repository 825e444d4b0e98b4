"""benchmarks.data_feed runs end to end on tiny settings (speed belongs in its printed ratios, not in tests)."""
from benchmarks.data_feed import main


def test_data_benchmark_compares_ours_with_timms_pipeline(capfd, tmp_path):
    results = main(["--images", "4", "--batch-size", "2", "--rounds", "2", "--latents", "8", "--input-size", "32",
                    "--breakdown", "--workdir", str(tmp_path)])
    deit, dit = results["deit"], results["dit"]
    assert deit["timm_per_s"] > 0 and deit["ours_per_s"] > 0 and deit["ratio"] > 0 and len(deit["rounds"]["ours"]) == 2
    assert dit["ours_per_s"] > 0 and len(dit["rounds"]["ours"]) == 2
    assert set(results["deit"]["breakdown"]) >= {"decode", "random-resized crop", "per-sample seeding"}
    out = capfd.readouterr().out  # the rounds print from the DataLoader worker process
    assert "deit round 2/2" in out and "dit round 1/2" in out and "ours/timm" in out and "JPEG draft mode" in out
    assert list(tmp_path.iterdir()) == []  # the inputs live in a temporary folder
