"""`make gpu-check`: the GPU figures in one command, printed and written as JSON (about 8 minutes on one GPU).

    make gpu-check                                    # python -m scripts.gpu_check --out runs/gpu_check.json
    python -m scripts.gpu_check --xl                  # also DiT-XL/2 at batch 32
    python -m scripts.gpu_check --skip-compile        # eager only (compiling four models takes minutes)

What it measures, all under bf16 autocast:

1. train-step time (forward, backward, AdamW), eager and ``torch.compile``d, peak memory and activation memory,
   Pre-Norm vs SiameseNorm and their ratio: DeiT-S/224 at batch 128, DiT-B/2 (32x32x4 latents) at batch 64;
2. host syncs per training step of both trainers, as users run them (the real ``Trainer`` on generated data):
   device values read by the host from project code on non-logging steps, and the syncs CUDA's own
   ``torch.cuda.set_sync_debug_mode("warn")`` reports;
3. the DeiT data feed with the recipe's default workers (``configs/deit_recipe.yaml``): images/s delivered to
   the GPU on ImageNet-sized JPEGs the script writes;
4. sampling: DiT-B/2 images/s with 250 DDPM steps through an SD-VAE-sized decoder (random weights: the same
   compute), and the FID-50K time that implies (sampling plus Inception features).

It stops with a clear message on a machine without a CUDA GPU (``--allow-cpu --tiny`` runs the same code on tiny
models on a CPU; the tests use that).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
PROJECT_DIRS = tuple(str(ROOT / d) for d in ("common", "vision", "diffusion"))


def log(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


class HostSyncCounter(TorchDispatchMode):
    """Counts the float/bool device values the host reads (``aten._local_scalar_dense``: ``.item()``, ``bool()``,
    ``float()``, ``.tolist()``) from project code, by ``file:line``. On a GPU each such read waits for the device.

    Integer reads are left out: on a CPU they cannot be told apart from host-side index bookkeeping (the sampler's
    ``int(order[i])``); values that decide or report training (a loss, a norm, a finite flag) are float or bool.
    """

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and (args[0].is_floating_point()
                                                                     or args[0].dtype == torch.bool):
            frames = [f for f in traceback.extract_stack() if f.filename.startswith(PROJECT_DIRS)]
            if frames:
                self.reads.append(f"{frames[-1].filename}:{frames[-1].lineno}")
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------- step time
def step_times(device, tiny: bool, compile_modes: Sequence[bool], xl: bool) -> dict:
    import timm

    import vision  # noqa: F401  (registers the DeiT topologies)
    from diffusion.models import DiT_models
    from scripts.bench_block import time_train_steps
    from scripts.bench_dit import dit_batch, dit_loss

    def deit_batch():
        size, b = (32, 4) if tiny else (224, 128)
        return torch.randn(b, 3, size, size), torch.randint(0, 1000, (b,))

    def deit_loss(model, batch):
        images, labels = batch
        return torch.nn.functional.cross_entropy(model(images), labels)

    deit_kw = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3) if tiny else {}
    cases = {"DeiT-S/224 b128": ({t: (lambda t=t: timm.create_model(
        "deit_small_patch16_224" if t == "pre" else "deit_small_siamese_patch16_224", **deit_kw)) for t in ("pre", "siamese")},
        deit_batch, deit_loss)}
    dits = [("DiT-B/2", 64)] + ([("DiT-XL/2", 32)] if xl else [])
    for name, b in dits:
        size = 8 if tiny else 32
        dit_kw = dict(hidden_size=48, depth=2, num_heads=3) if tiny else {}
        cases[f"{name} b{b}"] = (
            {t: (lambda t=t, name=name: DiT_models[name](input_size=size, topology=t, **dit_kw)) for t in ("pre", "siamese")},
            lambda b=b, size=size: dit_batch(2 if tiny else b, size, 4, 1000), dit_loss)
    out = {}
    for label, (builders, make_batch, loss_fn) in cases.items():
        for compiled in compile_modes:
            mode = "compiled" if compiled else "eager"
            log(f"{label}, {mode}")
            if compiled:
                torch._dynamo.reset()
            r = time_train_steps(builders, make_batch, loss_fn, steps=3 if tiny else 15, warmup=1 if tiny else 3,
                                 device=device, dtype=torch.bfloat16, compile=compiled, log=log)
            out[f"{label} {mode}"] = {**r, "siamese/pre time": r["siamese"]["median_ms"] / r["pre"]["median_ms"],
                                      "siamese/pre peak memory": r["siamese"]["peak_mem_mb"] / r["pre"]["peak_mem_mb"],
                                      "siamese/pre activations": r["siamese"]["activation_mb"] / r["pre"]["activation_mb"]}
    return out


# ----------------------------------------------------------------------------------- syncs per step
def write_image_folder(root: Path, count: int) -> None:
    """An ImageNet-layout folder (train/ and val/, two classes) of ImageNet-sized JPEGs (scripts.bench_data's)."""
    from scripts.bench_data import write_jpegs

    write_jpegs(root, count)  # root/train/class0, class1
    write_jpegs(root, 8, seed=1, split="val")


def trainer_syncs(workdir: Path, tiny: bool) -> dict:
    """Both trainers for a few steps on generated data; host reads counted on every non-logging step."""
    from common.config import load_config
    from common.trainer import Trainer
    from diffusion.task import DiTTask
    from diffusion.train import TrainConfig as DiTConfig
    from scripts.bench_data import write_latents
    from vision.task import DeiTTask
    from vision.train import TrainConfig as DeiTConfig

    write_image_folder(workdir / "images", 64)
    write_latents(workdir / "latents", 64, shard_size=64)
    size = 32 if tiny else 224
    runs = {
        "vision.train (deit_small_siamese recipe)": (DeiTConfig, DeiTTask, "deit_small_siamese.yaml", [
            f"data.path={workdir / 'images'}", "data.num_classes=2", f"data.input_size={size}", "data.num_workers=2",
            "optim.batch_size=16", "optim.epochs=1", "train.log_every=4", "train.eval_every=0", "train.compile=false"]
            + (["model.kwargs={embed_dim: 48, depth: 2, num_heads: 3, patch_size: 8}"] if tiny else [])),
        "diffusion.train (dit_b2_siamese recipe)": (DiTConfig, DiTTask, "dit_b2_siamese.yaml", [
            f"data.path={workdir / 'latents'}", "data.num_classes=1000", "data.autoencoder=none",
            "train.sample_every=0", "data.num_workers=2", "optim.batch_size=16", "optim.steps=4", "train.log_every=4",
            "train.compile=false"] + (["model.kwargs={hidden_size: 48, depth: 2, num_heads: 3}"] if tiny else [])),
    }
    out = {}
    original = Trainer.train_step
    for label, (schema, task_cls, recipe, overrides) in runs.items():
        counts = {}

        def counted(self, batches, counts=counts):
            if (self.step + 1) % self.run.log_every == 0 or self.step + 1 == self.total_steps:
                return original(self, batches)
            with warnings.catch_warnings(record=True) as caught, HostSyncCounter() as counter:
                warnings.simplefilter("always")
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    original(self, batches)
                finally:
                    if torch.cuda.is_available():
                        torch.cuda.set_sync_debug_mode("default")
            cuda_syncs = [str(w.message)[:120] for w in caught if "synchroniz" in str(w.message).lower()]
            counts[self.step + 1] = {"project_reads": counter.reads, "cuda_sync_warnings": cuda_syncs}

        Trainer.train_step = counted
        try:
            cfg = load_config(schema, ROOT / "configs" / recipe,
                              [*overrides, f"train.output_dir={workdir / recipe}", "train.tensorboard=true"])
            log(f"{label}: {len(counts) or 'a few'} steps")
            Trainer(cfg, task_cls(cfg)).fit()
        finally:
            Trainer.train_step = original
        out[label] = {"non-logging steps": len(counts),
                      "project host reads per step": max(len(c["project_reads"]) for c in counts.values()),
                      "cuda sync warnings per step": max(len(c["cuda_sync_warnings"]) for c in counts.values()),
                      "where": sorted({r for c in counts.values() for r in c["project_reads"] + c["cuda_sync_warnings"]})}
    return out


# ------------------------------------------------------------------------------------------ data feed
def data_feed(workdir: Path, device, tiny: bool) -> dict:
    """Images/s the DeiT feed delivers to the device with the recipe's default workers (no model)."""
    from common.config import from_dict, read_yaml
    from common.data import ResumableSampler
    from common.distributed import build_accelerator
    from vision.data import AugmentConfig, DataConfig
    from common.trainer import task_feed
    from vision.task import DeiTTask, TrainConfig

    write_image_folder(workdir / "feed", 128 if tiny else 2048)
    recipe = read_yaml(ROOT / "configs" / "deit_recipe.yaml")
    data = from_dict(DataConfig, {**recipe["data"], "path": str(workdir / "feed"), "num_classes": 2,
                                  **({"input_size": 32, "num_workers": 2} if tiny else {})})
    cfg = TrainConfig(data=data, augment=from_dict(AugmentConfig, recipe["augment"]))
    task = DeiTTask(cfg)
    task.setup(build_accelerator("bf16" if torch.cuda.is_available() else "fp32", None, tensorboard=False))
    batch = 32 if tiny else 128
    sampler = ResumableSampler(len(task.train_set), seed=0, repeats=cfg.augment.repeated_aug)
    feed = task_feed(task, sampler, batch, cfg.data.num_workers, device)
    batches, warmup = iter(feed), 2
    n = len(sampler) // batch
    for _ in range(warmup):
        next(batches)
    start = time.perf_counter()
    for i in range(warmup, n):
        images, _ = next(batches)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"workers": data.num_workers, "batch": batch, "images_per_s": (n - warmup) * batch / elapsed,
            "images": (n - warmup) * batch, "input_size": data.input_size}


# ------------------------------------------------------------------------------------------- sampling
SD_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
              layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
              up_block_types=("UpDecoderBlock2D",) * 4, sample_size=256, scaling_factor=0.18215)


def sampling(workdir: Path, device, tiny: bool) -> dict:
    """DiT-B/2 + an SD-VAE-sized decoder (random weights) through diffusion.sample's Sampler; FID-50K estimate."""
    from diffusers import AutoencoderKL

    from diffusion.models import DiT_models
    from diffusion.models import DiTSpec
    from diffusion.sampling import Decoder, Sampler

    vae_dir = workdir / "vae"
    vae_kw = dict(SD_VAE, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=8) if tiny else SD_VAE
    AutoencoderKL(**vae_kw).save_pretrained(vae_dir)
    size = 8 if tiny else 32
    model = DiT_models["DiT-B/2"](input_size=size, **(dict(hidden_size=48, depth=2, num_heads=3) if tiny else {}))
    spec = DiTSpec.published("DiT-B/2", input_size=size, autoencoder=str(vae_dir))
    steps, measured_steps, batch = 250, 5 if tiny else 25, 4 if tiny else 125
    diffusion = spec.diffusion(sampling_steps=steps)
    sampler = Sampler(model.to(device).eval(), spec, Decoder(str(vae_dir), device), diffusion, device=str(device))
    # Time a shortened chain (measured_steps of the 250) and the decode separately; scale the chain to 250.
    short = spec.diffusion(sampling_steps=measured_steps)
    indices, labels = torch.arange(batch), torch.arange(batch) % 1000
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        sampler.diffusion = short.to(device)
        sampler(indices, labels)  # warm-up
        _sync()
        start = time.perf_counter()
        sampler(indices, labels)
        _sync()
        short_s = time.perf_counter() - start
        latents = torch.randn(batch, 4, size, size, device=device)
        start = time.perf_counter()
        sampler.decoder(latents)
        _sync()
        decode_s = time.perf_counter() - start
    chain_s = (short_s - decode_s) * steps / measured_steps
    per_image = (chain_s + decode_s) / batch
    inception_per_image = inception_seconds_per_image(workdir, device, tiny)
    return {"model": "DiT-B/2 (random weights), cfg 1, bf16", "batch": batch, "steps": steps,
            "images_per_s": 1.0 / per_image, "decode_share": decode_s / (chain_s + decode_s),
            "inception_images_per_s": 1.0 / inception_per_image,
            "fid50k_minutes_one_gpu": 50_000 * (per_image + inception_per_image) / 60}


def inception_seconds_per_image(workdir: Path, device, tiny: bool) -> float:
    import torchvision

    from diffusion.evaluation.features import build_feature_extractor

    path = workdir / "inception.pth"
    model = torchvision.models.inception_v3(weights=None, aux_logits=False, num_classes=1008, init_weights=False)
    torch.save(model.state_dict(), path)
    extractor = build_feature_extractor("inception-v3-compat", ["2048"], path, device)
    images = torch.randint(0, 256, (8 if tiny else 100, 3, 64 if tiny else 256, 64 if tiny else 256),
                           dtype=torch.uint8, device=device)
    extractor(images)
    _sync()
    start = time.perf_counter()
    extractor(images)
    _sync()
    return (time.perf_counter() - start) / len(images)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ main
def print_table(results: dict) -> None:
    print("\n== train step, bf16 (ms, peak MB) ==")
    for label, r in results.get("step_time", {}).items():
        print(f"  {label:28s} pre {r['pre']['median_ms']:8.1f} ms {r['pre']['peak_mem_mb']:9.0f} MB | siamese "
              f"{r['siamese']['median_ms']:8.1f} ms {r['siamese']['peak_mem_mb']:9.0f} MB | ratio time "
              f"{r['siamese/pre time']:.3f}, peak {r['siamese/pre peak memory']:.3f}, "
              f"activations {r['siamese/pre activations']:.3f}")
    for label, r in results.get("host_syncs", {}).items():
        print(f"== host syncs, {label}: {r['project host reads per step']} project reads and "
              f"{r['cuda sync warnings per step']} CUDA sync warnings per non-logging step ({r['non-logging steps']} steps)")
    if "data_feed" in results:
        r = results["data_feed"]
        print(f"== DeiT data feed: {r['images_per_s']:.0f} images/s with {r['workers']} workers ({r['input_size']} px)")
    if "sampling" in results:
        r = results["sampling"]
        print(f"== sampling: {r['images_per_s']:.1f} images/s (250 steps, batch {r['batch']}); Inception "
              f"{r['inception_images_per_s']:.0f} images/s; FID-50K about {r['fid50k_minutes_one_gpu']:.0f} min on one GPU")


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__.split("\n\n")[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu_check.json", help="JSON results file")
    p.add_argument("--xl", action="store_true", help="also DiT-XL/2 at batch 32")
    p.add_argument("--skip-compile", action="store_true", help="eager step times only")
    p.add_argument("--only", nargs="+", choices=("step_time", "host_syncs", "data_feed", "sampling"),
                   help="run only these parts")
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # the tests' smoke run
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("error: make gpu-check measures a CUDA GPU, and this machine has none (torch.cuda.is_available() is "
              "False). Run it on a machine with an NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    parts = args.only or ["step_time", "host_syncs", "data_feed", "sampling"]
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if "step_time" in parts:
            results["step_time"] = step_times(device, args.tiny, (False,) if args.skip_compile else (False, True), args.xl)
        if "host_syncs" in parts:
            results["host_syncs"] = trainer_syncs(workdir / "syncs", args.tiny)
        if "data_feed" in parts:
            results["data_feed"] = data_feed(workdir, device, args.tiny)
        if "sampling" in parts:
            results["sampling"] = sampling(workdir, device, args.tiny)
    results["wall_s"] = time.perf_counter() - started
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    log(f"wrote {args.out} ({results['wall_s']:.0f} s)")
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
