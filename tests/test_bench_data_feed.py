"""benchmarks.data_feed runs end to end on tiny settings (speed belongs in its printed ratios, not in tests)."""
from benchmarks.data_feed import main


def test_data_benchmark_compares_ours_with_timms_pipeline_and_the_formats(capfd, tmp_path):
    results = main(["--images", "4", "--batch-size", "2", "--rounds", "2", "--latents", "8", "--input-size", "32",
                    "--breakdown", "--workdir", str(tmp_path)])
    deit, dit = results["deit"], results["dit"]
    assert deit["timm_per_s"] > 0 and deit["ours_per_s"] > 0 and deit["ratio"] > 0 and len(deit["rounds"]["ours"]) == 2
    assert dit["ours_per_s"] > 0 and len(dit["rounds"]["ours"]) == 2
    assert set(results["deit"]["breakdown"]) >= {"decode", "random-resized crop", "per-sample seeding"}
    formats = results["formats"]  # ours from the folder, WebDataset tars and a Hugging Face dataset
    assert set(formats["ratios"]) == {"wds", "hf"}
    assert all(formats[f"{f}_per_s"] > 0 and formats["read_us"][f] > 0 for f in ("imagefolder", "wds", "hf"))
    out = capfd.readouterr().out  # the rounds print from the DataLoader worker process
    assert "deit round 2/2" in out and "dit round 1/2" in out and "ours/timm" in out and "JPEG draft mode" in out
    assert "formats round 2/2" in out and "wds/imagefolder" in out and "hf/imagefolder" in out
    assert list(tmp_path.iterdir()) == []  # the inputs live in a temporary folder


def test_the_formats_alone(capfd, tmp_path):
    results = main(["--images", "4", "--batch-size", "2", "--rounds", "1", "--latents", "0", "--input-size", "32",
                    "--skip-timm", "--formats", "imagefolder", "wds", "--shard-size", "3", "--cpu-time",
                    "--workdir", str(tmp_path)])
    assert set(results) == {"formats"} and set(results["formats"]["ratios"]) == {"wds"}
    out = capfd.readouterr().out
    assert "ours per worker by format (median)   images/CPU-s" in out and "images/s of CPU time" in out
