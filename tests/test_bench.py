"""The benchmark script runs end to end (no timing assertions: speed belongs in the printed ratios)."""
from scripts.bench_block import main


def test_bench_block_reports_every_variant(capsys):
    results = main(["--steps", "1", "--warmup", "0", "--batch-size", "2", "--img-size", "16", "--patch-size", "8"])
    assert set(results) == {"pre", "siamese", "post"}
    assert results["siamese"]["params"] - results["pre"]["params"] == 19_200
    # Siamese saves more for backward (two streams, six norms per block) than Pre-Norm.
    assert results["siamese"]["activation_mb"] > results["pre"]["activation_mb"] > 0
    out = capsys.readouterr().out
    assert "x pre" in out and "siamese" in out


def test_bench_dit_reports_every_variant(capsys):
    from scripts.bench_dit import main as bench_dit

    results = bench_dit(["--models", "DiT-S/8", "--latent-size", "16", "--num-classes", "10", "--batch-size", "2",
                         "--steps", "1", "--warmup", "0", "--topologies", "pre,siamese"])["DiT-S/8"]
    assert results["siamese"]["params"] - results["pre"]["params"] == 12 * 8 * 384 + 4 * 384
    assert results["siamese"]["activation_mb"] > results["pre"]["activation_mb"] > 0
    assert "DiT-S/8" in capsys.readouterr().out
