"""The benchmark scripts run end to end (no timing assertions: speed belongs in the printed ratios)."""
from scripts.bench_block import main

TINY_DEIT = ["--batch-size", "2", "--img-size", "16", "--patch-size", "8"]
TINY_DIT = ["--models", "DiT-S/8", "--latent-size", "16", "--num-classes", "10", "--batch-size", "2"]


def test_bench_block_reports_every_variant_with_progress(capsys):
    variants = "pre,siamese-fused,siamese-stored,post"
    results = main(["--steps", "1", "--warmup", "0", "--topologies", variants, *TINY_DEIT])
    assert set(results) == {"pre", "siamese-fused", "siamese-stored", "post"}
    assert results["siamese-fused"]["params"] - results["pre"]["params"] == 19_200
    assert results["siamese-stored"]["params"] == results["siamese-fused"]["params"]
    # Siamese saves more for backward than Pre-Norm (two streams, six norms per block); storing its norm chain
    # instead of fusing it, more still.
    act = {name: r["activation_mb"] for name, r in results.items()}
    assert act["siamese-stored"] > act["siamese-fused"] > act["pre"] > 0
    out, err = capsys.readouterr()
    assert "x pre" in out and "siamese-stored" in out and "cpu ms" in out
    assert "siamese-fused/pre: step time" in out and "saved activations" in out
    assert "pre: ready" in err and "round 1/1" in err  # progress, on stderr, as it goes


def test_bench_block_memory_mode(capsys):
    results = main(["--memory", "--topologies", "pre,siamese", *TINY_DEIT])
    assert set(results["siamese"]) == {"float32 eager", "bfloat16 eager"}
    assert results["siamese"]["float32 eager"] > results["pre"]["float32 eager"] > 0
    # bf16 autocast keeps bf16 copies of the activations the matmuls read (the streams stay fp32)
    assert results["pre"]["bfloat16 eager"] < results["pre"]["float32 eager"]
    out, err = capsys.readouterr()
    assert "float32 eager MB" in out and "parameters excluded" in out
    assert "siamese/pre saved activations: float32 eager" in out
    assert "siamese bfloat16 eager" in err


def test_bench_dit_reports_every_variant(capsys):
    from scripts.bench_dit import main as bench_dit

    variants = "pre,siamese-fused,siamese-stored"
    results = bench_dit([*TINY_DIT, "--steps", "1", "--warmup", "0", "--topologies", variants])["DiT-S/8"]
    assert results["siamese-stored"]["params"] - results["pre"]["params"] == 12 * 8 * 384 + 4 * 384
    act = {name: r["activation_mb"] for name, r in results.items()}
    assert act["siamese-stored"] > act["siamese-fused"] > act["pre"] > 0
    out, err = capsys.readouterr()
    assert "DiT-S/8" in out and "DiT-S/8" in err


def test_bench_dit_memory_mode(capsys):
    from scripts.bench_dit import main as bench_dit

    results = bench_dit([*TINY_DIT, "--memory", "--topologies", "pre,siamese"])["DiT-S/8"]
    assert results["siamese"]["float32 eager"] > results["pre"]["float32 eager"] > 0
    assert "float32 eager MB" in capsys.readouterr().out
