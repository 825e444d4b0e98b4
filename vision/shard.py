"""Convert an ImageFolder into WebDataset tars or a Hugging Face dataset, and verify a conversion.

    python -m vision.shard --data-path /data/imagenet/train --out /data/imagenet-wds/train    # 1,000 images a tar
    python -m vision.shard --data-path /data/imagenet/train --out /data/imagenet-hf/train --format hf
    python -m vision.shard --verify /data/imagenet-wds/train
    python -m vision.shard --index /data/other-wds/train --classes wnids.txt     # tars written elsewhere

Images are copied byte for byte (never decoded or re-encoded) in the folder's order (torchvision's: sorted classes,
sorted files), so image ``i`` of the shards is image ``i`` of the folder: the same pixels, label and place in the
sampler's order (:mod:`common.image_sets` reads them). A damaged file is copied as it is; the readers skip it, as they
do in the folder.

* **wds**: ``shard-NNNNNN.tar`` of ``--shard-size`` images (members ``<class>/<file>.jpg`` and ``.cls``, WebDataset's
  layout), each with ``shard-NNNNNN.index.json`` (its members' offsets, sizes and labels), then ``manifest.json``.
* **hf**: a ``datasets`` folder (``save_to_disk``: ``image`` and ``label`` columns, ``ClassLabel`` names = the class
  folders), built from parts of ``--shard-size`` images in ``<out>.parts/`` and saved once they are all written
  (the disk holds the set twice until then), with ``manifest.json`` inside.

Tars written elsewhere (timm's ``wds``, other groups' ImageNet tars: ``<key>.jpg`` with ``<key>.cls`` or
``<key>.json`` holding ``{"label": N}``) are made readable in place by ``--index DIR --classes FILE``: the same index
beside each tar and manifest, the class names from the file (in label order), samples in the tars' own order.

Resumable: a shard is written to a temporary name and renamed when complete, so the same command after an interruption
writes only what is missing and never touches a finished shard; shards written from another folder or with other
settings are refused. Verifiable: the manifest records each shard's image count, size and sha256, which ``--verify``
checks (and, for tars, every member's offset and label).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

from common.cli import ArgumentParser, one_line_errors

DEFAULT_SHARD_SIZE = 1000  # about 110 MB of ImageNet JPEGs


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m vision.shard", description=__doc__.split("\n\n")[0] + " Re-run the same "
                       "command after an interruption: it writes only the missing shards.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-path", help="ImageFolder of one split (one sub-folder per class), e.g. IMAGENET/train")
    p.add_argument("--out", help="the folder of the shards, e.g. IMAGENET-wds/train (data.path/<split> of a run)")
    p.add_argument("--format", choices=("wds", "hf"), default="wds",
                   help="wds: WebDataset tars; hf: a Hugging Face datasets folder (load_from_disk)")
    p.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="images per tar (hf: per part)")
    p.add_argument("--verify", metavar="DIR", help="check a conversion against its manifest (count, size and sha256 of "
                   "every shard) instead of converting")
    p.add_argument("--index", metavar="DIR", help="make WebDataset tars written elsewhere readable (<key>.jpg with "
                   "<key>.cls or <key>.json {\"label\": N}): an index beside each tar and a manifest; needs --classes")
    p.add_argument("--classes", metavar="FILE", help="--index: the class names, one a line, in label order (ImageNet: "
                   "the sorted wnids)")
    args = p.parse_args(argv)
    if args.verify is None and args.index is None and not (args.data_path and args.out):
        p.error("give --data-path and --out to convert, --verify DIR to check a conversion, or --index DIR --classes "
                "FILE to index tars written elsewhere")
    if args.index is not None and not args.classes:
        p.error("--index needs --classes FILE: the class names in label order, which the readers check")
    if args.shard_size < 1:
        p.error("--shard-size must be positive")
    return args


def source_images(data_path: str):
    from common.data import ImageFolderError
    from common.image_sets import FolderImages

    try:
        return FolderImages(data_path)
    except (ImageFolderError, FileNotFoundError, NotADirectoryError) as err:
        raise ImageFolderError(f"--data-path {data_path} is not an ImageFolder ({err}); it must hold one sub-folder "
                               "per class with the images inside, e.g. IMAGENET/train/n01440764/*.JPEG") from None


def conversion_settings(kind: str, images, shard_size: int) -> dict:
    """What every shard of a conversion records: a shard with other settings is not one of this conversion's."""
    from common.image_sets import SHARDS_FORMAT

    listing = "\n".join(os.path.relpath(path, images.root) for path in images.files)
    return {"format": SHARDS_FORMAT, "kind": kind, "shard_size": shard_size, "count": len(images),
            "classes": list(images.classes), "listing_sha256": hashlib.sha256(listing.encode()).hexdigest()}


def refuse_other_settings(what: Path, saved: dict, settings: dict) -> None:
    from common.image_sets import ShardError

    diff = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v}
    if diff:
        shown = "; ".join(f"{k}: {_short(old)} then, {_short(new)} now" for k, (old, new) in diff.items())
        raise ShardError(f"{what} was written from another folder or with other settings ({shown}); run the command "
                         "that wrote it, or choose a new --out")


def _short(value) -> str:
    return f"{len(value)} classes" if isinstance(value, list) else repr(value)


def finished_manifest(out: Path, settings: dict):
    """The manifest of a finished conversion with these settings, None where there is none; refuses another's."""
    from common.image_sets import MANIFEST_FILE

    path = out / MANIFEST_FILE
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    refuse_other_settings(path, manifest, settings)
    return manifest


def member_key(relative: str) -> str:
    """A WebDataset key for an image file: its path without the extension, other dots as ``_`` (a key ends at the
    first dot of a member's name)."""
    stem = relative.rsplit(".", 1)[0]
    directory, _, base = stem.rpartition("/")
    return f"{directory}/{base.replace('.', '_')}" if directory else base.replace(".", "_")


def member_extension(path: str) -> str:
    ext = path.rsplit(".", 1)[-1].lower()
    return "jpg" if ext == "jpeg" else ext  # WebDataset's and timm's name for JPEG members


# ----------------------------------------------------------------------------- tars

def convert_wds(images, out: Path, shard_size: int) -> dict:
    from tqdm import tqdm

    from common.durable import atomic_write_text
    from common.image_sets import MANIFEST_FILE, SHARDS_FORMAT, index_name, shard_name

    settings = conversion_settings("wds", images, shard_size)
    manifest = finished_manifest(out, settings)
    if manifest is not None:
        print(f"{out} is converted already ({manifest['count']} images in {len(manifest['shards'])} shards); "
              f"nothing to do (--verify {out} checks it)")
        return manifest
    out.mkdir(parents=True, exist_ok=True)
    num_shards = math.ceil(len(images) / shard_size)
    done = {k for k in range(num_shards) if finished_tar(out, k, settings)}
    todo = [k for k in range(num_shards) if k not in done]
    print(f"{len(images)} images in {len(images.classes)} classes -> {num_shards} tars of {shard_size} in {out}; "
          f"{len(done)} written already", flush=True)
    with tqdm(total=sum(len(shard_range(k, shard_size, len(images))) for k in todo), unit="img",
              dynamic_ncols=True) as bar:
        for k in todo:
            write_tar(images, out, k, shard_range(k, shard_size, len(images)), settings, bar)
    shards = []
    for k in range(num_shards):
        index = json.loads((out / index_name(shard_name(k))).read_text())
        shards.append({key: index[key] for key in ("file", "count", "bytes", "sha256")})
    manifest = {**settings, "source": str(Path(images.root).resolve()), "shards": shards}
    assert manifest["format"] == SHARDS_FORMAT and sum(s["count"] for s in shards) == len(images)
    atomic_write_text(out / MANIFEST_FILE, json.dumps(manifest, indent=1))
    print(f"wrote {len(images)} images in {num_shards} tars and {out / MANIFEST_FILE}")
    return manifest


def shard_range(k: int, shard_size: int, count: int) -> range:
    return range(k * shard_size, min((k + 1) * shard_size, count))


def finished_tar(out: Path, k: int, settings: dict) -> bool:
    """Tar ``k`` is complete and of this conversion (its index matches it); another conversion's is refused."""
    from common.image_sets import index_name, shard_name

    tar, index_path = out / shard_name(k), out / index_name(shard_name(k))
    if not index_path.is_file():
        return False
    try:
        index = json.loads(index_path.read_text())
    except ValueError:
        return False  # written again
    refuse_other_settings(index_path, index.get("settings", {}), settings)
    return tar.is_file() and tar.stat().st_size == index["bytes"]


def write_tar(images, out: Path, k: int, items: range, settings: dict, bar) -> None:
    """Tar ``k`` of ``items``, and its index; the index is written first, the tar renamed into place last."""
    import webdataset

    from common.durable import atomic_write, atomic_write_text
    from common.image_sets import ShardError, file_sha256, index_name, scan_tar, shard_name

    name = shard_name(k)
    keys = {}
    with atomic_write(out / name) as tmp:
        with open(tmp, "wb") as f, webdataset.TarWriter(f, mtime=0) as writer:
            for i in items:
                path = images.files[i]
                key = member_key(os.path.relpath(path, images.root))
                if key in keys:
                    raise ShardError(f"{path} and {keys[key]} would be the same WebDataset sample {key} (a key ends "
                                     "at the first dot); rename one of them")
                keys[key] = path
                with open(path, "rb") as image:
                    writer.write({"__key__": key, "cls": int(images.labels[i]), member_extension(path): image.read()})
                bar.update(1)
        index = scan_tar(tmp)
        if index["labels"] != images.labels[items.start:items.stop].tolist():
            raise RuntimeError(f"{tmp} does not read back as written")
        index.update(file=name, sha256=file_sha256(tmp), settings=settings)
        atomic_write_text(out / index_name(name), json.dumps(index))


# ----------------------------------------------------------------------------- a Hugging Face dataset

def convert_hf(images, out: Path, shard_size: int) -> dict:
    import datasets
    from tqdm import tqdm

    from common.durable import atomic_write_text
    from common.image_sets import MANIFEST_FILE, ShardError

    datasets.disable_progress_bars()  # ours counts images
    settings = conversion_settings("hf", images, shard_size)
    manifest = finished_manifest(out, settings)
    if manifest is not None:
        print(f"{out} is converted already ({manifest['count']} images); nothing to do (--verify {out} checks it)")
        return manifest
    if out.exists() and any(out.iterdir()):
        raise ShardError(f"--out {out} holds files and no finished conversion's {MANIFEST_FILE}; choose a new or empty "
                         "--out (nothing there is overwritten)")
    parts = out.with_name(out.name + ".parts")
    parts.mkdir(parents=True, exist_ok=True)
    saved = parts / "settings.json"
    if saved.is_file():
        refuse_other_settings(parts, json.loads(saved.read_text()), settings)
    else:
        atomic_write_text(saved, json.dumps(settings))
    num_parts = math.ceil(len(images) / shard_size)
    names = [parts / f"part-{k:06d}" for k in range(num_parts)]
    todo = [k for k in range(num_parts) if not names[k].is_dir()]
    print(f"{len(images)} images in {len(images.classes)} classes -> {num_parts} parts of {shard_size} in {parts}; "
          f"{num_parts - len(todo)} written already", flush=True)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(images.classes))})
    with tqdm(total=sum(len(shard_range(k, shard_size, len(images))) for k in todo), unit="img",
              dynamic_ncols=True) as bar:
        for k in todo:
            rows = {"image": [], "label": []}
            for i in shard_range(k, shard_size, len(images)):
                with open(images.files[i], "rb") as f:
                    rows["image"].append({"bytes": f.read(), "path": os.path.relpath(images.files[i], images.root)})
                rows["label"].append(int(images.labels[i]))
                bar.update(1)
            tmp = names[k].with_name(names[k].name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)  # an interrupted part of ours
            datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp))
            os.replace(tmp, names[k])
    print("saving the parts as one dataset ...", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    whole = datasets.concatenate_datasets([datasets.load_from_disk(str(name)) for name in names])
    whole.save_to_disk(str(tmp), num_shards=num_parts)
    manifest = {**settings, "source": str(Path(images.root).resolve()), "shards": hf_shards(tmp)}
    atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1))
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(tmp, out)
    shutil.rmtree(parts)
    print(f"wrote {len(images)} images to {out}")
    return manifest


def hf_shards(folder: Path) -> list:
    """Count, size and sha256 of each Arrow file of a saved dataset, in its order."""
    import datasets

    from common.image_sets import file_sha256

    files = [entry["filename"] for entry in json.loads((folder / "state.json").read_text())["_data_files"]]
    return [{"file": name, "count": datasets.Dataset.from_file(str(folder / name)).num_rows,
             "bytes": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)} for name in files]


# ----------------------------------------------------------------------------- --index

def index_tars(folder: Path, classes_file: Path) -> dict:
    """Index every ``*.tar`` of ``folder`` (sorted by name; samples in their order in the tar) and write the manifest,
    so that tars written elsewhere read as the converter's do. Resumable: an indexed tar is not read again."""
    import numpy as np
    from tqdm import tqdm

    from common.cli import InputNotFoundError
    from common.durable import atomic_write_text
    from common.image_sets import (MANIFEST_FILE, SHARDS_FORMAT, ShardError, check_labels, file_sha256, index_name,
                                   scan_tar)

    if not classes_file.is_file():
        raise InputNotFoundError(f"--classes {classes_file}: no such file; give the class names, one a line, in label "
                                 "order")
    classes = [line.strip() for line in classes_file.read_text().splitlines() if line.strip()]
    tars = sorted(folder.glob("*.tar"))
    if not tars:
        raise ShardError(f"--index {folder} holds no .tar files")
    settings = {"format": SHARDS_FORMAT, "kind": "wds", "classes": classes}
    shards = []
    for tar in tqdm(tars, unit="tar", dynamic_ncols=True):
        path = folder / index_name(tar.name)
        index = json.loads(path.read_text()) if path.is_file() else None
        if index is not None:
            refuse_other_settings(path, index.get("settings", {}), settings)
        if index is None or index["bytes"] != tar.stat().st_size:
            index = scan_tar(tar)
            check_labels(np.array(index["labels"], dtype=np.int64), len(classes),
                         lambda j, index=index, tar=tar: f"{tar}:{index['members'][j]}")
            index.update(file=tar.name, sha256=file_sha256(tar), settings=settings)
            atomic_write_text(path, json.dumps(index))
        shards.append({key: index[key] for key in ("file", "count", "bytes", "sha256")})
    manifest = {**settings, "count": sum(s["count"] for s in shards), "source": "indexed", "shards": shards}
    atomic_write_text(folder / MANIFEST_FILE, json.dumps(manifest, indent=1))
    print(f"indexed {manifest['count']} images in {len(shards)} tars of {folder}: data.format=wds reads them")
    return manifest


# ----------------------------------------------------------------------------- --verify

def verify(folder: Path) -> dict:
    """Every shard against the manifest; the problems are listed, then refused in one line."""
    from tqdm import tqdm

    from common.image_sets import ShardError, file_sha256, index_name, read_manifest, read_shard_index, scan_tar

    manifest = read_manifest(folder)
    problems = []
    for shard in tqdm(manifest["shards"], unit="shard", dynamic_ncols=True):
        path = folder / shard["file"]
        try:
            if not path.is_file():
                raise ShardError(f"{path} is missing")
            if manifest["kind"] == "wds":
                found = scan_tar(path)  # a truncated tar, a sample without its label: named by member
            if path.stat().st_size != shard["bytes"]:
                raise ShardError(f"{path} has {path.stat().st_size} bytes, the manifest says {shard['bytes']}")
            if file_sha256(path) != shard["sha256"]:
                raise ShardError(f"{path}: its sha256 differs from the manifest's (the same size, other bytes)")
            if manifest["kind"] == "wds":
                index = read_shard_index(folder, shard)
                for key in ("members", "offsets", "sizes", "labels"):
                    if found[key] != index[key]:
                        raise ShardError(f"{path}: its members' {key} differ from {index_name(shard['file'])}")
                count = found["count"]
            else:
                import datasets

                count = datasets.Dataset.from_file(str(path)).num_rows
            if count != shard["count"]:
                raise ShardError(f"{path} holds {count} images, the manifest says {shard['count']}")
        except ShardError as err:
            problems.append(str(err))
            tqdm.write(f"bad: {err}")
    if problems:
        raise ShardError(f"{len(problems)} of {len(manifest['shards'])} shards in {folder} fail verification (first: "
                         f"{problems[0]}); delete each one named above and run the conversion command again: it "
                         "rewrites only the missing shards")
    print(f"{folder}: {manifest['count']} images in {len(manifest['shards'])} shards, each as its manifest says "
          "(count, size, sha256)")
    return manifest


def main(argv=None) -> dict:
    args = parse_args(argv)
    with one_line_errors():
        if args.verify is not None:
            return verify(Path(args.verify))
        if args.index is not None:
            return index_tars(Path(args.index), Path(args.classes))
        images = source_images(args.data_path)
        if Path(args.out).resolve().is_relative_to(Path(args.data_path).resolve()):
            from common.image_sets import ShardError

            raise ShardError(f"--out {args.out} is inside --data-path {args.data_path}, where it would become a class "
                             "folder of the next listing; choose an --out outside it")
        convert = convert_wds if args.format == "wds" else convert_hf
        return convert(images, Path(args.out), args.shard_size)


if __name__ == "__main__":
    main()
