"""Labelled image sets read by index, whatever holds them: an ImageFolder, WebDataset tars, a Hugging Face dataset.

    images = open_image_set("wds", "/data/imagenet-wds", "train")    # or "imagefolder", "hf"
    len(images), images.classes, images.labels[i]                       # class names in label order
    images.read(i)      # what a loader decodes: the file's path (imagefolder) or the encoded bytes (wds, hf)
    images.name(i)      # what a warning names: the file, "<shard>.tar:<member>", or "<dataset>#<row> (<file>)"

Why index-addressable (map-style) rather than streamed: item ``i`` is the ``i``-th image of the ImageFolder the
shards were converted from (``python -m vision.shard``), so :class:`common.data.ResumableSampler` gives every format
the folder's guarantees unchanged: one seeded global order on any number of processes, per-rank and per-worker
sharding, resume at the exact next image.

* **wds**: a folder of ``shard-NNNNNN.tar`` (WebDataset members ``<key>.jpg`` + ``<key>.cls``; tars written
  elsewhere once ``python -m vision.shard --index`` indexed them), the ``shard-NNNNNN.index.json`` beside each
  (every sample's image member, byte offset and size in the tar, and label: the offsets the tar format gives, read by
  :mod:`tarfile`) and ``manifest.json`` (class names, per-shard count, size and sha256). An image is one
  ``pread`` at its offset: no tar is walked at start-up or per item, and no ImageNet-sized folder of small files is
  listed.
* **hf**: a ``datasets`` folder (``save_to_disk``; read by ``load_from_disk``, memory-mapped), or a Hub dataset name
  where the machine reaches the Hub; its ``Image`` column is read undecoded and its ``ClassLabel`` column gives the
  labels and class names.

A tar shorter than its manifest says, a sample without a label and a manifest that is missing are refused in one
line naming the shard and member (:class:`ShardError`); a damaged image inside a shard is the reader's to skip, as a
damaged file of a folder is (:class:`vision.data.ReadableImages`).
"""
from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from common.cli import InputError, InputNotFoundError
from common.data import IMAGE_EXTENSIONS, scan_image_folder

FORMATS = ("imagefolder", "wds", "hf")
SHARDS_FORMAT = "siamesenorm-shards-v1"
MANIFEST_FILE = "manifest.json"
LABEL_EXTENSIONS = ("cls", "json")  # WebDataset's label members: "<key>.cls" holds the class index as text
TAR_IMAGE_EXTENSIONS = tuple(ext.lstrip(".") for ext in IMAGE_EXTENSIONS)
CONVERT = "python -m vision.shard"


class ShardError(InputError):
    """Shards that cannot be read as the set their manifest describes: truncated, unlabelled, missing, foreign."""


def shard_name(k: int) -> str:
    return f"shard-{k:06d}.tar"


def index_name(tar_name: str) -> str:
    """The index file beside a tar: ``shard-000003.tar`` -> ``shard-000003.index.json``."""
    return tar_name[: -len(".tar")] + ".index.json"


def file_sha256(path: Union[str, os.PathLike]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_path(encoded) -> bool:
    """Whether what :meth:`ImageSet.read` gave is a file's path (else it is the encoded bytes, as any buffer)."""
    return isinstance(encoded, (str, os.PathLike))


def open_encoded(encoded):
    """A binary file object over what :meth:`ImageSet.read` gives: a path, or the encoded bytes."""
    return open(encoded, "rb") if is_path(encoded) else io.BytesIO(encoded)


# ----------------------------------------------------------------------------- the sets

class ImageSet:
    """A labelled image set read by index: ``classes``, ``labels`` (int64, one per image), ``read(i)``, ``name(i)``."""

    classes: List[str]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, i: int):
        """What a loader decodes: a file path, or the encoded image bytes."""
        raise NotImplementedError

    def name(self, i: int) -> str:
        raise NotImplementedError

    @property
    def samples(self) -> Sequence:
        """``(name, label)`` per image, as torchvision's ``ImageFolder.samples`` (made when asked)."""
        return _Samples(self)


class _Samples(Sequence):
    def __init__(self, images: ImageSet):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Tuple[str, int]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.images.name(i), int(self.images.labels[i])


class FolderImages(ImageSet):
    """An ImageFolder (``root/<class>/**/<image>``) in torchvision's class and file order."""

    def __init__(self, root: Union[str, os.PathLike]):
        self.root = str(root)
        self.classes, samples = scan_image_folder(root)
        self.files = [path for path, _ in samples]
        self.labels = np.array([label for _, label in samples], dtype=np.int64)

    @property
    def samples(self) -> list:
        return list(zip(self.files, self.labels.tolist()))

    def read(self, i: int) -> str:
        return self.files[i]

    def name(self, i: int) -> str:
        return self.files[i]


class TarImages(ImageSet):
    """WebDataset tars converted by ``python -m vision.shard``, read by byte offset (see the module docstring)."""

    def __init__(self, folder: Union[str, os.PathLike]):
        self.folder = Path(folder)
        manifest = read_manifest(self.folder, "wds")
        self.classes = list(manifest["classes"])
        self.files, shard_of, offsets, sizes, labels = [], [], [], [], []
        for k, shard in enumerate(manifest["shards"]):
            index = read_shard_index(self.folder, shard)
            check_tar_size(self.folder / shard["file"], index)
            self.files.append(str(self.folder / shard["file"]))
            shard_of.append(np.full(index["count"], k, dtype=np.int32))
            offsets.append(index["offsets"])
            sizes.append(index["sizes"])
            labels.append(index["labels"])
        self.shard_of = np.concatenate(shard_of)
        self.offsets = np.concatenate(offsets).astype(np.int64)
        self.sizes = np.concatenate(sizes).astype(np.int64)
        self.labels = np.concatenate(labels).astype(np.int64)
        self.first = np.concatenate([[0], np.cumsum([len(s) for s in shard_of])])  # item index of each shard's first
        check_labels(self.labels, len(self.classes), lambda i: self.name(i))
        self._open: "collections.OrderedDict[int, int]" = collections.OrderedDict()  # shard -> fd, per process
        self._members: Dict[int, List[str]] = {}  # shard -> its image members' names, read when one is named

    def __getstate__(self):  # file descriptors stay in the process that opened them
        return {**self.__dict__, "_open": collections.OrderedDict(), "_members": {}}

    def __del__(self):
        for fd in getattr(self, "_open", {}).values():
            try:
                os.close(fd)
            except (OSError, TypeError):  # closed already, or at interpreter exit
                pass

    def _fd(self, shard: int) -> int:
        fd = self._open.get(shard)
        if fd is None:
            if len(self._open) >= open_files_allowed():
                os.close(self._open.popitem(last=False)[1])
            fd = self._open[shard] = os.open(self.files[shard], os.O_RDONLY)
        self._open.move_to_end(shard)
        return fd

    def read(self, i: int) -> bytes:
        return os.pread(self._fd(int(self.shard_of[i])), int(self.sizes[i]), int(self.offsets[i]))  # short: undecodable

    def name(self, i: int) -> str:
        shard = int(self.shard_of[i])
        if shard not in self._members:
            self._members[shard] = read_shard_index(self.folder, {"file": Path(self.files[shard]).name})["members"]
        return f"{self.files[shard]}:{self._members[shard][i - self.first[shard]]}"


class HfImages(ImageSet):
    """A Hugging Face ``datasets`` split: its ``Image`` column undecoded, its ``ClassLabel`` column as labels."""

    def __init__(self, path: str, split: Optional[str] = None):
        from datasets import ClassLabel
        from datasets import Image as ImageFeature

        dataset, self.where = open_hf_dataset(path, split)
        features = dataset.features
        image = [k for k, f in features.items() if isinstance(f, ImageFeature)]
        label = [k for k, f in features.items() if isinstance(f, ClassLabel)]
        if not image or not label:
            kinds = ", ".join(f"{k} ({type(f).__name__})" for k, f in features.items())
            raise ShardError(f"{self.where} needs an Image column and a ClassLabel column (class names in label "
                             f"order); it has {kinds}. Convert the ImageFolder with {CONVERT} --format hf")
        self.classes = list(features[label[0]].names)
        column = dataset.data.column(label[0])
        if column.null_count:
            first = int(np.flatnonzero(np.asarray(column.is_null()))[0])
            raise ShardError(f"{self.where}#{first} has no label (column {label[0]} is empty there); every image "
                             f"needs its class: label those rows or leave them out of the dataset")
        self.labels = np.asarray(column).astype(np.int64)
        check_labels(self.labels, len(self.classes), lambda i: f"{self.where}#{i}")
        self.column = image[0]
        self.images = dataset.select_columns([self.column]).cast_column(self.column, ImageFeature(decode=False))
        self._rows = None  # the image column's Arrow data, opened per process (memory-mapped)

    def __getstate__(self):  # a pickled copy (a spawned worker) maps the files itself, never copies the table
        return {**self.__dict__, "_rows": None}

    def _stored(self, i: int, field: str):
        """Row ``i``'s ``bytes`` (a buffer over the memory-mapped file, no copy) or ``path``: from the Arrow column,
        a tenth of ``datasets``' row formatting, where its rows are the dataset's (no indices mapping reorders them)."""
        if self._rows is None:
            direct = getattr(self.images, "_indices", None) is None
            self._rows = self.images.data.column(self.column) if direct else False
        if self._rows is False:
            return self.images[int(i)][self.column][field]
        value = self._rows[int(i)][field]
        return value.as_buffer() if field == "bytes" and value.is_valid else value.as_py()

    def read(self, i: int):
        data = self._stored(i, "bytes")
        return data if data is not None else self._stored(i, "path")

    def name(self, i: int) -> str:
        path = self._stored(i, "path")
        return f"{self.where}#{i}" + (f" ({path})" if path else "")


def open_image_set(fmt: str, path: Union[str, os.PathLike], split: Optional[str] = None) -> ImageSet:
    """The images of ``path`` (``path/split`` when ``split`` is given; hf: a split of a dataset or of the Hub)."""
    if fmt not in FORMATS:
        raise ValueError(f"image set format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "hf":
        return HfImages(str(path), split)
    folder = Path(path) / split if split else Path(path)
    if fmt == "wds":
        return TarImages(folder)
    return FolderImages(folder)


def open_hf_dataset(path: str, split: Optional[str]):
    """``(dataset, where)``: ``path/split`` or ``path`` saved by ``save_to_disk`` (a ``DatasetDict`` gives its
    ``split``), else the Hub's dataset ``path``, split ``split``."""
    import datasets

    folder = Path(path)
    candidates = ([folder / split] if split else []) + [folder]
    for where in candidates:
        if (where / "state.json").is_file() or (where / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(str(where))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ShardError(f"{where} holds the splits {', '.join(loaded)}, not {split!r}; name one of them "
                                     "(data.train_split / data.val_split, or --split)")
                return loaded[split], f"{where}[{split}]"
            return loaded, str(where)
    if folder.exists():
        raise ShardError(f"{' nor '.join(map(str, candidates))} is a Hugging Face dataset folder (written by "
                         f"save_to_disk: state.json or dataset_dict.json); convert an ImageFolder with {CONVERT} "
                         "--format hf, or check data.path")
    try:
        return datasets.load_dataset(path, split=split or "train"), f"{path}[{split or 'train'}]"
    except Exception as err:  # noqa: BLE001 -- the Hub client raises many types; each means "not here"
        raise ShardError(f"{path} is neither a local folder nor a Hub dataset this machine can load "
                         f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); give the "
                         "folder of a saved dataset, or a Hub name with network access") from None


# ----------------------------------------------------------------------------- manifests and indexes

def read_manifest(folder: Path, kind: Optional[str] = None) -> dict:
    """``folder/manifest.json`` of a finished conversion (of kind ``kind``, where given), or a one-line refusal."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        if not folder.is_dir():
            raise InputNotFoundError(f"{folder} does not exist; convert the ImageFolder into it with {CONVERT} "
                                     f"--data-path IMAGEFOLDER --out {folder} (or check data.path)")
        raise ShardError(f"{folder} has no {MANIFEST_FILE}: its conversion did not finish (run the same {CONVERT} "
                         "command again to finish it), or these tars were not written by it (convert the ImageFolder)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ShardError(f"{path} is damaged ({err}); run the conversion command again to rewrite it") from None
    if manifest.get("format") != SHARDS_FORMAT:
        raise ShardError(f"{path} is not a {SHARDS_FORMAT} manifest (format {manifest.get('format')!r}); convert the "
                         f"ImageFolder with {CONVERT}")
    if kind is not None and manifest["kind"] != kind:
        raise ShardError(f"{folder} holds a {manifest['kind']} conversion, not {kind}: set data.format="
                         f"{manifest['kind']} (diffusion.extract_latents: --data-format {manifest['kind']})")
    return manifest


def read_shard_index(folder: Path, shard: dict) -> dict:
    path = folder / index_name(shard["file"])
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ShardError(f"{path}, the index of {shard['file']}, cannot be read ({type(err).__name__}: {err}); run "
                         f"{CONVERT} --verify {folder}, and the conversion command again to rewrite it") from None
    if "count" in shard and (index["count"], index["bytes"]) != (shard["count"], shard["bytes"]):
        raise ShardError(f"{path} describes another {shard['file']} than {MANIFEST_FILE} does ({index['count']} "
                         f"images, {index['bytes']} bytes; the manifest: {shard['count']}, {shard['bytes']}); run "
                         f"{CONVERT} --verify {folder}")
    return index


def check_tar_size(tar: Path, index: dict) -> None:
    """The tar's size against its index: a truncated tar is refused naming the member it ends in."""
    try:
        size = tar.stat().st_size
    except FileNotFoundError:
        raise ShardError(f"{tar} is missing; restore it, or delete its index and run the conversion command again "
                         "to rewrite it") from None
    if size == index["bytes"]:
        return
    if size < index["bytes"]:
        ends = [o + s for o, s in zip(index["offsets"], index["sizes"])]
        cut = next((j for j, end in enumerate(ends) if end > size), None)
        where = (f"inside member {index['members'][cut]}" if cut is not None else
                 f"after its last member {index['members'][-1]}, without the end-of-archive blocks")
        raise ShardError(f"{tar} is truncated: {size} of {index['bytes']} bytes, it ends {where}; restore the file, "
                         "or delete it and run the conversion command again")
    raise ShardError(f"{tar} has {size} bytes, its index says {index['bytes']}: it is not the tar that was converted; "
                     f"run {CONVERT} --verify {tar.parent}")


def check_labels(labels: np.ndarray, num_classes: int, name) -> None:
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(bad):
        raise ShardError(f"{name(int(bad[0]))} has label {labels[bad[0]]}, outside the {num_classes} classes (0 to "
                         f"{num_classes - 1}); {len(bad)} image(s) are unlabelled or mislabelled. Label them, or "
                         "leave them out of the set")


def scan_tar(path: Union[str, os.PathLike]) -> dict:
    """Every sample of a WebDataset tar, by :mod:`tarfile`: ``{"members": image member names, "offsets", "sizes",
    "labels", "count", "bytes"}``. A member that runs past the end of the file, a sample without a label
    (``<key>.cls`` / ``<key>.json``) or without an image is refused naming the shard and the member."""
    path = Path(path)
    size = path.stat().st_size
    samples: Dict[str, dict] = {}
    try:
        with tarfile.open(path, "r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                if info.offset_data + info.size > size:
                    raise ShardError(f"{path} is truncated: {size} bytes, it ends inside member {info.name}; restore "
                                     "the file, or delete it and run the conversion command again")
                directory, _, base = info.name.rpartition("/")
                stem, _, ext = base.partition(".")
                key = f"{directory}/{stem}" if directory else stem
                entry = samples.setdefault(key, {})
                if ext.lower() in LABEL_EXTENSIONS:
                    tar.fileobj.seek(info.offset_data)
                    entry["label"] = _label(tar.fileobj.read(info.size), ext.lower(), path, info.name)
                elif ext.lower() in TAR_IMAGE_EXTENSIONS:
                    entry["image"] = (info.name, info.offset_data, info.size)
    except tarfile.ReadError as err:
        raise ShardError(f"{path} is not a readable tar ({err}); restore it, or delete it and run the conversion "
                         "command again") from None
    members, offsets, sizes, labels = [], [], [], []
    for key, entry in samples.items():
        if "image" not in entry:
            raise ShardError(f"{path}: sample {key} has no image member ({', '.join(TAR_IMAGE_EXTENSIONS)}); "
                             "remove the sample or add its image")
        if "label" not in entry:
            raise ShardError(f"{path}: member {entry['image'][0]} has no label ({key}.cls or {key}.json); every "
                             "image needs its class: convert the ImageFolder again")
        members.append(entry["image"][0])
        offsets.append(entry["image"][1])
        sizes.append(entry["image"][2])
        labels.append(entry["label"])
    return {"members": members, "offsets": offsets, "sizes": sizes, "labels": labels, "count": len(members),
            "bytes": size}


def _label(data: bytes, ext: str, path: Path, member: str) -> int:
    try:
        return int(data.decode().strip()) if ext == "cls" else int(json.loads(data)["label"])
    except (ValueError, KeyError, TypeError):
        raise ShardError(f"{path}: member {member} holds no class index ({data[:40]!r}); every image needs its "
                         "class: convert the ImageFolder again") from None


_OPEN_FILES_ALLOWED = None


def open_files_allowed() -> int:
    """How many shards a process keeps open: a quarter of its open-file limit, raised to the hard limit first (a
    reopen per image would cost the file system the metadata operation shards exist to save)."""
    global _OPEN_FILES_ALLOWED
    if _OPEN_FILES_ALLOWED is None:
        try:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if hard == resource.RLIM_INFINITY or hard > soft:
                target = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
        except (ImportError, OSError, ValueError):
            soft = 1024
        _OPEN_FILES_ALLOWED = max(8, soft // 4)
    return _OPEN_FILES_ALLOWED

