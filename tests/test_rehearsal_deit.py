"""Rehearsal of the DeiT ImageNet recipe as shipped: configs/deit_tiny_siamese.yaml (+ deit_recipe.yaml) run by
``python -m vision.train`` and ``torchrun``, then ``python -m vision.evaluate``, on a generated ImageNet-like folder.

Only data paths, sizes and step counts are changed on the command line; every augmentation the recipe turns on
(RandAugment rand-m9-mstd0.5-inc1, mixup/cutmix, label smoothing, random erasing, repeated augmentation x3, drop
path, EMA) and TensorBoard stay on, and the data loaders use worker processes.

With Pillow >= 13, timm's increasing posterize in rand-m9-mstd0.5-inc1 asks for 0 bits now and then, which Pillow
refuses (``ValueError: bits must be between or equal to 1 and 8``) and which would end these runs (exit 1) in a
DataLoader worker within their first epoch; vision.augment.posterize_keeping_bits keeps them running. That the 0-bit draws really happen, and
give a black image, is asserted by tests/test_vision_data.py (20,000 recipe transforms).
"""
import json
import math

import pytest
from safetensors.torch import load_file
from torchvision.datasets import ImageFolder

from common.data import ResumableSampler
from common.logging import read_metrics
from tests.rehearsal import ROOT, check, recipe_changes, run, write_image_folder

TRAIN_PER_CLASS, VAL_PER_CLASS, CLASSES, BATCH, EPOCHS = 12, 3, 4, 16, 2


def shrunk(data, out):
    """The recipe's command line with data, sizes and step counts made small."""
    return ["--config", ROOT / "configs/deit_tiny_siamese.yaml", f"data.path={data}", f"data.num_classes={CLASSES}",
            "data.input_size=32", "data.num_workers=2", "model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}",
            f"optim.batch_size={BATCH}", f"optim.epochs={EPOCHS}", "optim.warmup_epochs=1", "train.log_every=1",
            f"train.output_dir={out}"]


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagenet")
    train = write_image_folder(root / "train", CLASSES, TRAIN_PER_CLASS, seed=0)
    val = write_image_folder(root / "val", CLASSES, VAL_PER_CLASS, seed=1, truncated_in=2)
    return root, train, val


@pytest.fixture(scope="module")
def one_process(imagenet, tmp_path_factory):
    root, _, _ = imagenet
    out = tmp_path_factory.mktemp("deit_one")
    return out, run("vision.train", *shrunk(root, out))


def expected_train_skips(root, truncated, world):
    """1 if the trainer meets the truncated training file (its place in the sampler's global order over the steps
    run, the same order for any number of processes), else 0: files are counted, not encounters."""
    files = [str(p) for p, _ in ImageFolder(root / "train").samples]
    sampler = ResumableSampler(len(files), world, 0, seed=0, repeats=3)
    consumed = len(sampler) // (BATCH // world) * BATCH  # global samples of the full steps of an epoch
    index = files.index(str(root / "train" / truncated))
    return int(any(bool((sampler.global_order(e)[:consumed] == index).any()) for e in range(EPOCHS)))


def test_recipe_trains_with_every_augmentation_then_evaluates(imagenet, one_process):
    root, train, val = imagenet
    out, proc = one_process
    check(proc)  # see the module docstring: RandAugment's 0-bit posterize must not end this run
    # The command line changed data, sizes and step counts only: every augmentation, drop path, EMA and
    # TensorBoard are the recipe's.
    assert set(recipe_changes(ROOT / "configs/deit_tiny_siamese.yaml", out)) == {
        "data.num_classes", "data.input_size", "data.num_workers", "optim.batch_size", "optim.epochs",
        "optim.warmup_epochs", "train.log_every", "train.output_dir"}

    steps = EPOCHS * (train["files"] // BATCH)
    records = read_metrics(out)
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), losses
    final = json.loads((out / "final_metrics.json").read_text())
    assert final["steps"] == steps and final["nonfinite_steps"] == 0
    for key in ("val/top1", "val/top5", "val/loss", "val_ema/top1", "val_ema/loss"):
        assert math.isfinite(final[key]), key
    assert list((out / "tb").rglob("events.out.tfevents.*")), "TensorBoard events"
    assert (out / "ema.safetensors").is_file() and list((out / "checkpoints").glob("step_*.pt"))

    # The truncated training file is named, counted, and the run goes on.
    skips = expected_train_skips(root, train["truncated"], world=1)
    assert skips > 0, "the test data must make the trainer meet the truncated file"
    assert final["skipped_images"] == skips
    assert f"skipping unreadable image {root / 'train' / train['truncated']}" in proc.stderr

    # python -m vision.evaluate on the run, as docs/deit.md shows it.
    ev = check(run("vision.evaluate", "--config", out / "config.yaml", f"checkpoint={out / 'model.safetensors'}"))
    result = json.loads((out / "model.eval.json").read_text())
    assert all(math.isfinite(result[k]) for k in ("top1", "top5", "loss"))
    assert f"skipping unreadable image {root / 'val' / val['truncated']}" in ev.stderr
    # Top-1 is computed on exactly the readable images; the unreadable one is counted and named.
    unreadable = str(root / "val" / val["truncated"])
    assert result["images"] == val["files"] - 1
    assert result["unreadable"] == 1 and result["unreadable_files"] == [unreadable]
    assert f"({val['files'] - 1} images; 1 unreadable, left out: {unreadable})" in ev.stdout
    assert result["top1"] == pytest.approx(final["val/top1"], abs=1e-9)  # the trainer's own final evaluation


def test_recipe_under_torchrun_two_processes_on_tars(imagenet, one_process, tmp_path):
    """Two processes (gloo), TensorBoard on, reading the folder converted to WebDataset tars (python -m vision.shard;
    two DataLoader workers a process): exit 0, and what the README promises equal to one process on the folder: the
    same schedule and the same data order (hence the same unreadable-image count) and an exact once-per-image
    evaluation. The weights are not compared: mixup/cutmix and drop path draw per rank, so they differ from one
    process (one process on tars: tests/test_shards.py)."""
    from vision import shard

    root, train, val = imagenet
    for split in ("train", "val"):
        shard.main(["--data-path", str(root / split), "--out", str(tmp_path / "wds" / split), "--shard-size", "8"])
    proc = check(run("vision.train", *shrunk(tmp_path / "wds", tmp_path / "run"), "data.format=wds", nproc=2))
    two = tmp_path / "run"
    member = val["truncated"].replace(".JPEG", ".jpg")  # named by its tar and member
    assert f"skipping unreadable image {tmp_path / 'wds' / 'val'}/shard-" in proc.stderr
    assert f".tar:{member}" in proc.stderr
    one, one_proc = one_process
    check(one_proc)
    assert list((two / "tb").rglob("events.out.tfevents.*"))
    a, b = read_metrics(one), read_metrics(two)
    assert b[0]["world_size"] == 2
    assert {k: b[0][k] for k in ("steps_per_epoch", "total_steps", "params", "lr_peak")} == \
           {k: a[0][k] for k in ("steps_per_epoch", "total_steps", "params", "lr_peak")}
    assert [r["train/lr"] for r in b if "train/lr" in r] == [r["train/lr"] for r in a if "train/lr" in r]
    final_one = json.loads((one / "final_metrics.json").read_text())
    final_two = json.loads((two / "final_metrics.json").read_text())
    assert final_two["skipped_images"] == final_one["skipped_images"] == expected_train_skips(
        root, train["truncated"], world=2)
    assert final_two["val/images"] == final_one["val/images"] == val["files"] - 1
    assert final_two["val/unreadable"] == final_one["val/unreadable"] == 1
    assert all(math.isfinite(final_two[k]) for k in ("val/top1", "val/loss", "val_ema/loss"))
    assert load_file(two / "model.safetensors").keys() == load_file(one / "model.safetensors").keys()
