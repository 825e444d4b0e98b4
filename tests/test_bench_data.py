"""scripts.bench_data runs end to end on tiny settings (speed belongs in its printed ratios, not in tests)."""
from scripts.bench_data import main


def test_bench_data_compares_both_paths(capfd, tmp_path):
    results = main(["--images", "4", "--batch-size", "2", "--rounds", "2", "--latents", "8", "--input-size", "32",
                    "--breakdown", "--workdir", str(tmp_path)])
    for name in ("deit", "dit"):
        r = results[name]
        assert r["old_per_s"] > 0 and r["new_per_s"] > 0 and r["ratio"] > 0 and len(r["rounds"]["new"]) == 2
    assert set(results["deit"]["breakdown"]) >= {"decode", "random-resized crop", "per-sample seeding"}
    out = capfd.readouterr().out  # the rounds print from the DataLoader worker process
    assert "deit round 2/2" in out and "dit round 1/2" in out and "new/old" in out and "JPEG draft mode" in out
    assert list(tmp_path.iterdir()) == []  # the inputs live in a temporary folder
