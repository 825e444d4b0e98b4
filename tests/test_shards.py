"""ImageNet as clusters hold it: an ImageFolder converted by ``python -m vision.shard`` into WebDataset tars and into a
Hugging Face dataset reads as the same images, labels and order; DeiT trains the same weights from all three and
resumes mid-epoch to them; the converter resumes and verifies; bad shards end in one line. (Two processes:
tests/test_rehearsal_deit.py trains on the tars under torchrun, tests/test_rehearsal_dit.py extracts latents from the
dataset under torchrun; latents from each format: tests/test_latents.py.)"""
import json
import os
import shutil
import tarfile
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.config import ConfigError, load_config
from common.image_sets import TarImages, open_image_set
from tests.refusals import refusal
from tests.rehearsal import ROOT, write_image_folder
from vision import evaluate as vision_evaluate
from vision import shard
from vision.train import TrainConfig, train
from vision.train import main as train_main

torch.set_num_threads(1)
CLASSES = 3
FORMATS = ("imagefolder", "wds", "hf")
TINY = ["model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32",
        f"data.num_classes={CLASSES}", "optim.batch_size=4", "optim.epochs=2", "optim.warmup_epochs=1",
        "train.eval_every=1", "train.eval_batch_size=4", "train.tensorboard=false", "train.threads=1",
        "train.log_every=1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """An ImageNet-like folder (train: 13 files, val: 10, each with one truncated JPEG, and gray, CMYK, PNG and EXIF
    files) and its conversions: ``{"imagefolder": root, "wds": root, "hf": root, "train": ..., "val": ...}``."""
    base = tmp_path_factory.mktemp("shards")
    folder = base / "imagenet"
    made = {"train": write_image_folder(folder / "train", CLASSES, 4, seed=0),
            "val": write_image_folder(folder / "val", CLASSES, 3, seed=1, truncated_in=1)}
    for fmt, size in (("wds", 5), ("hf", 4)):
        for split in ("train", "val"):
            shard.main(["--data-path", str(folder / split), "--out", str(base / fmt / split), "--format", fmt,
                        "--shard-size", str(size)])
    return {"imagefolder": folder, "wds": base / "wds", "hf": base / "hf", **made}


def test_every_format_reads_the_folders_images_labels_and_order(data):
    for split in ("train", "val"):
        sets = {fmt: open_image_set(fmt, data[fmt], split) for fmt in FORMATS}
        folder = sets["imagefolder"]
        assert len(folder) == data[split]["files"] and len({len(s) for s in sets.values()}) == 1
        for fmt, images in sets.items():
            assert images.classes == folder.classes == ["n01440764", "n01443537", "n01484850"]
            assert images.labels.tolist() == folder.labels.tolist(), fmt
            assert [encoded(images, i) for i in range(len(images))] == \
                [Path(folder.read(i)).read_bytes() for i in range(len(folder))], fmt
    tars = open_image_set("wds", data["wds"], "train")
    assert len(tars.files) == 3 and tars.name(12).endswith("shard-000002.tar:n01484850/n01484850_0003.jpg")


def encoded(images, i) -> bytes:
    data = images.read(i)
    return Path(data).read_bytes() if isinstance(data, str) else bytes(data)  # a tar's bytes, an Arrow buffer


def config(run, data, fmt, *extra):
    return load_config(TrainConfig, ROOT / "configs/deit_tiny_siamese.yaml",
                       [*TINY, f"data.path={data[fmt]}", f"data.format={fmt}", f"train.output_dir={run}",
                        "augment.repeated_aug=1", *extra])


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def measured(final: dict) -> dict:
    """What a run's final metrics say of the model and the data (not the speed, not the files' names)."""
    return {k: v for k, v in final.items() if not k.endswith(("_per_s", "data_wait", "unreadable_files"))}


def test_deit_trains_the_same_weights_from_every_format_and_resumes_mid_epoch_to_them(data, tmp_path):
    """The recipe's augmentations (RandAugment, mixup/cutmix, erasing, drop path, EMA; repeated augmentation off, so
    that the epochs meet the truncated JPEG) on 13 training images: 3 steps an epoch, 2 epochs. The tars are read by
    a DataLoader worker, the others in the process. The truncated JPEG is skipped and counted alike; evaluation names
    it by shard and member."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="skipping unreadable image")
        finals = {fmt: train(config(tmp_path / fmt, data, fmt, f"data.num_workers={int(fmt == 'wds')}"))
                  for fmt in FORMATS}
        stopped = config(tmp_path / "resumed", data, "wds", "data.num_workers=1", "train.stop_at_step=4")
        assert train(stopped) == {"stopped_at": 4}  # mid-epoch: epoch 2's first step done
        train(config(tmp_path / "resumed", data, "wds", "data.num_workers=1"))
    for fmt in ("wds", "hf"):
        assert same_weights(tmp_path / "imagefolder", tmp_path / fmt), fmt
        assert measured(finals[fmt]) == measured(finals["imagefolder"]), fmt  # losses, Top-1, skipped images
    assert same_weights(tmp_path / "imagefolder", tmp_path / "resumed")
    assert finals["wds"]["steps"] == 6 and finals["wds"]["val/unreadable"] == 1
    assert finals["wds"]["skipped_images"] == 1  # the truncated training JPEG, met in the sampler's order
    with pytest.warns(UserWarning, match="skipping unreadable image .*shard-000001.tar:n01443537/truncated.jpg"):
        result = vision_evaluate.main(["--config", str(tmp_path / "wds" / "config.yaml"),
                                       f"checkpoint={tmp_path / 'wds' / 'model.safetensors'}", "data.num_workers=0"])
    assert result["top1"] == finals["wds"]["val/top1"] and result["images"] == data["val"]["files"] - 1
    member = data["val"]["truncated"].replace(".JPEG", ".jpg")
    assert result["unreadable_files"] == [f"{data['wds'] / 'val' / 'shard-000001.tar'}:{member}"]


def test_conversion_resumes_without_touching_finished_shards_and_refuses_other_settings(data, tmp_path, monkeypatch,
                                                                                         capsys):
    src, out = data["imagefolder"] / "train", tmp_path / "wds"
    reference = json.loads((data["wds"] / "train" / "manifest.json").read_text())
    write = shard.write_tar

    def interrupted(images, out_, k, *args):
        if k == 1:
            raise KeyboardInterrupt  # a kill while tar 1 is written
        write(images, out_, k, *args)

    monkeypatch.setattr(shard, "write_tar", interrupted)
    with pytest.raises(KeyboardInterrupt):
        shard.main(["--data-path", str(src), "--out", str(out), "--shard-size", "5"])
    assert sorted(p.name for p in out.iterdir()) == ["shard-000000.index.json", "shard-000000.tar"]
    first = (out / "shard-000000.tar").stat().st_mtime_ns
    monkeypatch.setattr(shard, "write_tar", write)
    shard.main(["--data-path", str(src), "--out", str(out), "--shard-size", "5"])
    assert (out / "shard-000000.tar").stat().st_mtime_ns == first
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shards"] == reference["shards"]  # byte-identical tars: the same sha256 as an uninterrupted run
    assert f"-> 3 tars of 5 in {out}; 1 written already" in capsys.readouterr().out
    assert "is inside --data-path" in refusal(shard.main, ["--data-path", src, "--out", src / "wds"], capsys)
    line = refusal(shard.main, ["--data-path", src, "--out", out, "--shard-size", "4"], capsys)
    assert "written from another folder or with other settings (shard_size: 5 then, 4 now)" in line
    assert "choose a new --out" in line

    parts = tmp_path / "hf.parts"
    save = __import__("datasets").Dataset.save_to_disk
    calls = []

    def interrupted_save(self, path, *args, **kwargs):
        calls.append(path)
        save(self, path, *args, **kwargs)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill before part 1 is renamed into place

    monkeypatch.setattr("datasets.Dataset.save_to_disk", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        shard.main(["--data-path", str(src), "--out", str(tmp_path / "hf"), "--format", "hf", "--shard-size", "4"])
    assert sorted(p.name for p in parts.iterdir()) == ["part-000000", "part-000001.tmp", "settings.json"]
    monkeypatch.setattr("datasets.Dataset.save_to_disk", save)
    shard.main(["--data-path", str(src), "--out", str(tmp_path / "hf"), "--format", "hf", "--shard-size", "4"])
    assert not parts.exists()
    again = open_image_set("hf", tmp_path / "hf")
    assert again.labels.tolist() == open_image_set("hf", data["hf"], "train").labels.tolist()


def test_verify_passes_a_conversion_and_names_a_changed_truncated_or_unlabelled_shard(data, tmp_path, capsys):
    for fmt in ("wds", "hf"):
        assert shard.main(["--verify", str(data[fmt] / "train")])["count"] == data["train"]["files"]
    out = tmp_path / "train"
    shutil.copytree(data["wds"] / "train", out)
    tar = out / "shard-000001.tar"
    raw = bytearray(tar.read_bytes())
    raw[-2048] ^= 1  # inside the end-of-archive blocks: the tar still reads, its sha256 differs
    tar.write_bytes(bytes(raw))
    line = refusal(shard.main, ["--verify", out], capsys)
    assert f"1 of 3 shards in {out} fail verification (first: {tar}: its sha256 differs" in line
    assert "delete each one named above and run the conversion command again" in line

    # A sample without its label: the tar rewritten without one .cls member.
    with tarfile.open(data["wds"] / "train" / "shard-000001.tar") as src, tarfile.open(tar, "w") as dst:
        members = src.getmembers()
        for info in members:
            if info.name != members[2].name:
                dst.addfile(info, src.extractfile(info))
    assert members[2].name.endswith(".cls")
    line = refusal(shard.main, ["--verify", out], capsys)
    assert f"{tar}: member {members[3].name} has no label" in line


def test_tars_written_elsewhere_are_indexed_in_place_and_read_in_their_order(data, tmp_path, capsys):
    """timm-like tars (WebDataset keys of its own, labels in .cls or .json members) become readable by --index:
    the same bytes and labels as the folder they hold, in the tars' order; a sample without a label is refused."""
    import webdataset

    folder = open_image_set("imagefolder", data["imagefolder"], "train")
    out = tmp_path / "timm-wds"
    out.mkdir()
    for k, start in enumerate(range(0, len(folder), 6)):
        with webdataset.TarWriter(str(out / f"imagenet-train-{k:04d}.tar")) as writer:
            for i in range(start, min(start + 6, len(folder))):
                label = {"json": {"label": int(folder.labels[i])}} if i == 1 else {"cls": int(folder.labels[i])}
                writer.write({"__key__": f"{i:08d}", "jpg": Path(folder.read(i)).read_bytes(), **label})
    (tmp_path / "wnids.txt").write_text("\n".join(folder.classes) + "\n")
    with pytest.raises(SystemExit):
        shard.main(["--index", str(out)])
    assert "error: --index needs --classes FILE" in capsys.readouterr().err
    manifest = shard.main(["--index", str(out), "--classes", str(tmp_path / "wnids.txt")])
    assert manifest["count"] == len(folder) and len(manifest["shards"]) == 3
    tars = open_image_set("wds", out)
    assert tars.labels.tolist() == folder.labels.tolist() and tars.classes == folder.classes
    assert [encoded(tars, i) for i in range(len(tars))] == \
        [Path(folder.read(i)).read_bytes() for i in range(len(folder))]
    assert shard.main(["--verify", str(out)])["count"] == len(folder)

    with webdataset.TarWriter(str(out / "imagenet-train-0003.tar")) as writer:
        writer.write({"__key__": "unlabelled", "jpg": Path(folder.read(0)).read_bytes()})
    line = refusal(shard.main, ["--index", out, "--classes", tmp_path / "wnids.txt"], capsys)
    tar = out / "imagenet-train-0003.tar"
    assert f"{tar}: member unlabelled.jpg has no label (unlabelled.cls or unlabelled.json)" in line


def test_bad_shards_end_in_one_line_naming_the_shard_and_member(data, tmp_path, capsys):
    args = lambda root, fmt="wds": ["--config", ROOT / "configs/deit_tiny_siamese.yaml", *TINY,  # noqa: E731
                                    f"data.path={root}", f"data.format={fmt}", f"train.output_dir={tmp_path / 'run'}"]
    root = tmp_path / "wds"
    shutil.copytree(data["wds"], root)
    tar = root / "train" / "shard-000001.tar"
    index = json.loads((root / "train" / "shard-000001.index.json").read_text())
    tar.write_bytes(tar.read_bytes()[: index["offsets"][2] + 10])  # cut inside the third image
    line = refusal(train_main, args(root), capsys)
    assert f"{tar} is truncated: {index['offsets'][2] + 10} of {index['bytes']} bytes, it ends inside member " \
           f"{index['members'][2]}" in line
    assert not (tmp_path / "run").exists()  # refused before the run directory is written

    (root / "train" / "manifest.json").unlink()  # an unfinished conversion
    assert "has no manifest.json: its conversion did not finish (run the same python -m vision.shard command again" \
        in refusal(train_main, args(root), capsys)
    assert f"{data['hf'] / 'train'} holds a hf conversion, not wds: set data.format=hf" in \
        refusal(train_main, args(data["hf"]), capsys)
    assert f"{tmp_path / 'none' / 'train'} does not exist; convert the ImageFolder into it" in \
        refusal(train_main, args(tmp_path / "none"), capsys)

    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    unlabelled = datasets.Dataset.from_dict({"image": [{"bytes": b"x", "path": f"{i}.jpg"} for i in range(3)],
                                             "label": [0, None, 1]}, features=features)
    unlabelled.save_to_disk(str(tmp_path / "hf" / "train"))
    assert f"{tmp_path / 'hf' / 'train'}#1 has no label" in refusal(train_main, args(tmp_path / "hf", "hf"), capsys)


def test_format_settings_are_checked_with_the_config():
    with pytest.raises(ConfigError, match="data.dataset=fashion_mnist has its own files: leave data.format"):
        load_config(TrainConfig, ROOT / "configs/fmnist_deit_siamese.yaml", ["data.format=wds"])
    with pytest.raises(ConfigError, match="data.backend=dali reads image files: it needs data.format=imagefolder"):
        load_config(TrainConfig, ROOT / "configs/deit_tiny_siamese.yaml", ["data.path=x", "data.format=hf",
                                                                           "data.backend=dali"])
    with pytest.raises(ConfigError, match="data.format"):
        load_config(TrainConfig, ROOT / "configs/deit_tiny_siamese.yaml", ["data.path=x", "data.format=zip"])


def test_a_spawned_worker_opens_the_shards_itself(data):
    """What a process opened stays its own: a pickled copy (a spawned worker) opens its own tar descriptors and maps
    the Arrow files itself (a pickled column would copy the table). A dataset whose rows an indices mapping reorders
    is read through ``datasets``' rows, not the Arrow column."""
    import pickle

    tars = TarImages(data["wds"] / "train")
    first = tars.read(0)
    copy = pickle.loads(pickle.dumps(tars))
    assert copy._open == {} and copy.read(0) == first and set(tars._open) == {0}
    assert os.fstat(tars._open[0]).st_size == (data["wds"] / "train" / "shard-000000.tar").stat().st_size

    rows = open_image_set("hf", data["hf"], "train")
    last = rows.read(len(rows) - 1)
    assert rows._rows is not None and len(pickle.dumps(rows)) < 10_000
    assert pickle.loads(pickle.dumps(rows))._rows is None
    rows.images, rows._rows = rows.images.select(range(len(rows) - 1, -1, -1)), None
    assert rows.read(0) == last and rows._rows is False
