"""Data pieces both families need: Fashion-MNIST from IDX files, and a resumable, deterministic sampler.

Fashion-MNIST::

    images, labels = load_fashion_mnist("train")          # uint8 [60000, 28, 28], int64 [60000]
    ds = FashionMNIST("test", transform=..., mode="RGB")  # PIL images, like torchvision's dataset

Files are looked up in Debian's ``dataset-fashion-mnist`` location (``/usr/share/datasets/fashion-mnist``)
first, then under a torchvision root (``<root>/FashionMNIST/raw`` or ``<root>`` itself).

Sampling::

    sampler = ResumableSampler(len(ds), num_replicas=world, rank=rank, seed=0, repeats=3)
    loader = build_train_loader(ds, sampler, batch_size=b, num_workers=w)
    sampler.set_epoch(epoch, start=samples_already_consumed_globally)

:class:`ResumableSampler` yields ``(index, sample_seed)``; :class:`SeededDataset` runs the wrapped
dataset's ``__getitem__`` (and so its random augmentations) under that seed. Augmentations then depend
only on ``(seed, epoch, position in the epoch)``: not on the number of workers, the number of processes
or whether the run was resumed mid-epoch. That is what makes kill-and-resume and 1-vs-N-process runs
reproduce the same batches. The loader's workers persist across epochs.

Feeding the device::

    for batch in DevicePrefetcher(loader, device, transform=batch_transform): ...

:class:`DevicePrefetcher` copies each batch to the device one batch ahead (a side CUDA stream) and runs an
optional batch transform there, e.g. :class:`vision.augment.NormalizeErase` on uint8 images; a transform's
``before_copy(batch)``, where it has one, runs on the host batch first (reading what the host already holds
costs no sync).
"""
from __future__ import annotations

import contextlib
import gzip
import math
import os
import random
import struct
from pathlib import Path
from typing import Callable, Iterator, Optional, Tuple, Union

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import collate as collate_with_map
from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

from common.cli import InputError, InputNotFoundError
from common.preemption import STOP_SIGNALS

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
_SPLIT_PREFIX = {"train": "train", "test": "t10k", "val": "t10k"}
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


# ----------------------------------------------------------------------------- ADM center crop
def center_crop_arr(image: Image.Image, image_size: int) -> Image.Image:
    """ADM's crop: halve with a box filter while the short side is >= 2x the target, resize the
    short side to ``image_size`` with bicubic, then take the central square."""
    while min(image.size) >= 2 * image_size:
        image = image.resize(tuple(s // 2 for s in image.size), resample=Image.BOX)
    scale = image_size / min(image.size)
    image = image.resize(tuple(round(s * scale) for s in image.size), resample=Image.BICUBIC)
    left = (image.size[0] - image_size) // 2
    top = (image.size[1] - image_size) // 2
    return image.crop((left, top, left + image_size, top + image_size))


# ----------------------------------------------------------------------------- image folders
# torchvision's ImageFolder extensions; one list for every folder reader of the project.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class ImageFolderError(InputNotFoundError):
    """A folder of images that cannot be read as one: a symlink loop, an empty class, no images."""


def image_files(folder: Union[str, os.PathLike], extensions: Tuple[str, ...] = IMAGE_EXTENSIONS) -> list:
    """Every image file below ``folder``, in torchvision's ``make_dataset`` order (directories as ``os.walk``
    lists them, sorted by path; files sorted within one).

    Symlinked folders are followed, as torchvision does, but a link back to a folder above it is refused: walking
    it would list the same files over and over, without end.
    """
    folder = str(folder)
    walked = []
    # The real folders a walked path went through; a link to one of them, or to a folder above one, never ends.
    chains = {folder: {os.path.realpath(folder)}}
    for root, dirs, files in os.walk(folder, followlinks=True):
        chain = chains.pop(root)
        for d in dirs:
            link = os.path.join(root, d)
            target = os.path.realpath(link)
            if any(seen == target or seen.startswith(target.rstrip(os.sep) + os.sep) for seen in chain):
                raise ImageFolderError(f"{link} is a symlink loop: it leads back to {target}, a folder above it, "
                                       f"so its images would be listed without end; remove the link")
            chains[link] = chain | {target}
        walked.append((root, dirs, files))
    return [os.path.join(root, f) for root, _, files in sorted(walked) for f in sorted(files)
            if f.lower().endswith(extensions)]


def scan_image_folder(folder: Union[str, os.PathLike], extensions: Tuple[str, ...] = IMAGE_EXTENSIONS):
    """``(classes, samples)`` of an ImageFolder layout (``folder/<class>/**/<image>``) as torchvision's
    ``ImageFolder`` finds them: classes are the sorted sub-folder names, ``samples`` ``(path, class index)`` pairs.
    A class folder without images, a folder without class folders and a symlink loop are refused by name."""
    classes = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())
    if not classes:
        raise ImageFolderError(f"{folder} has no class sub-folders; expected {folder}/<class name>/<image> files")
    samples = []
    for index, name in enumerate(classes):
        found = image_files(os.path.join(folder, name), extensions)
        if not found:
            raise ImageFolderError(f"class folder {os.path.join(folder, name)} and its sub-folders hold no images "
                                   f"({', '.join(extensions)}): add its images or remove the folder (every "
                                   f"sub-folder of {folder} is a class)")
        samples += [(path, index) for path in found]
    return classes, samples


# ----------------------------------------------------------------------------- Fashion-MNIST

def read_idx(path: Union[str, os.PathLike]) -> np.ndarray:
    """Read an IDX file (optionally gzipped), the format of MNIST and Fashion-MNIST."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise InputError(f"{path} is not an IDX file (bad magic number {data[:4].hex()})")
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4: 4 + 4 * ndim])
    array = np.frombuffer(data, dtype=_IDX_DTYPES[data[2]], offset=4 + 4 * ndim)
    if array.size != math.prod(shape):
        raise InputError(f"{path} is truncated: header says {shape}, found {array.size} values")
    return array.reshape(shape)


def find_fashion_mnist(split: str, root: Optional[Union[str, os.PathLike]] = None) -> Tuple[Path, Path]:
    """Paths of the (images, labels) IDX files of a split, Debian location first, then ``root``."""
    if split not in _SPLIT_PREFIX:
        raise InputError(f"Fashion-MNIST has no split {split!r}: choose train or test")
    prefix = _SPLIT_PREFIX[split]
    # A given root is where the files must be (never silently replaced by the system copy); else Debian's location.
    candidates = [DEBIAN_FASHION_MNIST] if root is None else [Path(root) / "FashionMNIST" / "raw", Path(root)]
    for d in candidates:
        for suffix in (".gz", ""):
            images = d / f"{prefix}-images-idx3-ubyte{suffix}"
            labels = d / f"{prefix}-labels-idx1-ubyte{suffix}"
            if images.is_file() and labels.is_file():
                return images, labels
    raise InputNotFoundError(
        f"Fashion-MNIST {split} files ({prefix}-images-idx3-ubyte[.gz], {prefix}-labels-idx1-ubyte[.gz]) not found in "
        f"{', '.join(str(c) for c in candidates)}. Install them with `sudo apt-get install dataset-fashion-mnist` "
        "(or `make data`), or pass the directory of a torchvision download as data.path."
    )


def load_fashion_mnist(split: str, root: Optional[Union[str, os.PathLike]] = None) -> Tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [N, 28, 28], labels int64 [N])`` of the ``train`` or ``test`` split."""
    images_path, labels_path = find_fashion_mnist(split, root)
    images, labels = read_idx(images_path), read_idx(labels_path).astype(np.int64)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise InputError(f"{images_path} / {labels_path}: shapes {images.shape} / {labels.shape} are not an image set")
    return images, labels


class FashionMNIST(Dataset):
    """Fashion-MNIST as ``(PIL image, label)`` pairs (``mode="RGB"`` for 3-channel models).

    ``limit`` keeps the first ``limit`` samples (for quick runs and tests).
    """

    classes = FASHION_MNIST_CLASSES

    def __init__(self, split: str = "train", root=None, transform=None, mode: str = "L", limit: Optional[int] = None):
        self.images, self.labels = load_fashion_mnist(split, root)
        if limit is not None:
            self.images, self.labels = self.images[:limit], self.labels[:limit]
        self.transform = transform
        self.mode = mode

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = Image.fromarray(self.images[index])  # uint8 HxW -> mode "L"
        if self.mode != "L":
            image = image.convert(self.mode)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])


# ----------------------------------------------------------------------------- deterministic sampling

def sample_seed(seed: int, epoch: int, position: int) -> int:
    """A 32-bit seed that depends only on (run seed, epoch, global position in the epoch)."""
    return int(np.random.SeedSequence([int(seed), int(epoch), int(position)]).generate_state(1)[0])


@contextlib.contextmanager
def seeded_rng(seed: int):
    """Run a block with python/numpy/torch(CPU) seeded to ``seed``; restore the global states afterwards.

    Seeds the CPU generator itself (``torch.default_generator.manual_seed``: the same stream as
    ``torch.manual_seed``, which also queues a seed for every accelerator backend, on a CUDA build a lazy call
    that records a Python stack: about 0.2 ms per item, and which left the CUDA generator re-seeded by the last
    item when the loader ran in the main process). Inside a DataLoader worker the states are not restored:
    nothing else draws from them there, and every item reseeds them (saving and restoring numpy's state alone
    costs about 0.1 ms).
    """
    restore = torch.utils.data.get_worker_info() is None
    if restore:
        py, npy, th = random.getstate(), np.random.get_state(), torch.default_generator.get_state()
    random.seed(seed)
    np.random.seed(seed)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        if restore:
            random.setstate(py)
            np.random.set_state(npy)
            torch.default_generator.set_state(th)


class SeededDataset(Dataset):
    """Wrap a map-style dataset so that item ``(index, seed)`` is produced under ``seeded_rng(seed)``.

    Plain integer keys pass through unseeded (for evaluation loaders). An error raised while producing a
    seeded item names the key, so the failing item can be reproduced outside the loader.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        if isinstance(key, tuple):
            index, seed = key
            try:
                with seeded_rng(seed):
                    return self.dataset[index]
            except Exception as err:
                add_note(err, f"while producing item {index} under sample seed {seed} "
                              f"(reproduce with SeededDataset(dataset)[({index}, {seed})])")
                raise
        return self.dataset[key]


def add_note(err: BaseException, note: str) -> None:
    """``err.add_note(note)`` where Python has it (3.11+): the traceback then carries the context."""
    if hasattr(err, "add_note"):
        err.add_note(note)


class ResumableSampler(Sampler):
    """Shuffled, sharded, optionally repeated sampling that can restart at any position of an epoch.

    Each epoch builds one global order: a permutation of the dataset (seeded by ``seed`` and the epoch),
    each index repeated ``repeats`` times in a row (repeated augmentation, DeiT: 3), truncated to
    ``epoch_samples`` (default: the dataset size, so an epoch costs the same with or without repeats, as
    in DeiT) rounded down to a multiple of ``num_replicas``. Rank ``r`` takes positions ``r, r + W, ...``.
    Unlike DeiT's RASampler this also repeats with a single process: the copies of an image then land
    in the same batch instead of on different GPUs; either way the global batch holds the same samples.

    Yields ``(index, sample_seed)`` pairs for :class:`SeededDataset`.

    ``set_epoch(epoch, start)`` selects the epoch and skips the first ``start`` samples of its global order
    (``start`` counts all ranks; it must be a multiple of ``num_replicas``), which is how a run resumes
    mid-epoch.
    """

    def __init__(self, num_samples: int, num_replicas: int = 1, rank: int = 0, seed: int = 0, shuffle: bool = True,
                 repeats: int = 1, epoch_samples: Optional[int] = None):
        if num_samples <= 0:
            raise InputError("the dataset is empty; nothing to sample")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, num_replicas={num_replicas})")
        if repeats < 1:
            raise ValueError(f"repeats={repeats} must be >= 1 (1 disables repeated augmentation)")
        self.num_samples = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.repeats = repeats
        total = num_samples if epoch_samples is None else min(epoch_samples, num_samples * repeats)
        self.total = (total // num_replicas) * num_replicas
        if self.total == 0:
            raise InputError(f"{num_samples} samples cannot be split over {num_replicas} processes")
        self.epoch = 0
        self.start = 0

    def __len__(self) -> int:
        """Samples this rank yields in a full epoch."""
        return self.total // self.num_replicas

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        if start % self.num_replicas or not 0 <= start <= self.total:
            raise ValueError(f"start={start} must be a multiple of num_replicas={self.num_replicas} in [0, {self.total}]")
        self.epoch = epoch
        self.start = start

    def global_order(self, epoch: int) -> torch.Tensor:
        """The epoch's global index order (all ranks interleaved), before the ``start`` offset."""
        if self.shuffle:
            epoch_seed = int(np.random.SeedSequence([int(self.seed), int(epoch)]).generate_state(1)[0])
            g = torch.Generator().manual_seed(epoch_seed)
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        order = order.repeat_interleave(self.repeats)
        if len(order) < self.total:  # only when epoch_samples asks for more than one pass
            order = order.repeat(math.ceil(self.total / len(order)))
        return order[: self.total]

    def __iter__(self) -> Iterator[Tuple[int, int]]:
        order = self.global_order(self.epoch)
        for position in range(self.start + self.rank, self.total, self.num_replicas):
            yield int(order[position]), sample_seed(self.seed, self.epoch, position)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "start": self.start, "seed": self.seed, "repeats": self.repeats,
                "total": self.total, "num_samples": self.num_samples}


def resolve_num_workers(setting: Union[int, str]) -> int:
    """``data.num_workers``: a number, or ``auto``: the CPUs this process may use, shared by the processes of this
    machine, less one for the process itself (0 on a single CPU: load in the main process)."""
    if setting != "auto":
        if not (isinstance(setting, int) or str(setting).isdigit()) or int(setting) < 0:
            raise InputError(f"num_workers={setting!r}: a number of worker processes >= 0, or auto")
        return int(setting)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, cpus // max(1, local) - 1)


def pad_batch(rows: torch.Tensor, size: int) -> torch.Tensor:
    """``rows`` filled up to ``size`` with copies of its last one: a compiled model's fixed batch (the caller cuts the
    padding's outputs off)."""
    pad = size - rows.shape[0]
    return torch.cat([rows, rows[-1:].expand(pad, *rows.shape[1:])]) if pad > 0 else rows


def _ignore_signals(names, worker_id: int) -> None:
    import signal

    for name in names:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def _kill_daemonic_children() -> None:
    """At exit, before multiprocessing's own handler terminates (SIGTERM) and joins its daemonic children, which
    would wait for ever on workers that ignore SIGTERM: kill them."""
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def ignore_in_workers(names=STOP_SIGNALS) -> Callable[[int], None]:
    """A ``worker_init_fn`` that makes DataLoader workers ignore the stop signals. A scheduler signals the whole
    process group; the main process stops at its next step boundary, and must still have its workers for that step
    (by default torch's workers die on SIGTERM, and the main process with them). They end when their loader shuts
    them down, when their parent dies, or killed at the parent's exit."""
    import atexit
    import functools

    global _KILL_AT_EXIT
    if not _KILL_AT_EXIT:
        atexit.register(_kill_daemonic_children)  # runs before multiprocessing's (registered at its import)
        _KILL_AT_EXIT = True
    return functools.partial(_ignore_signals, tuple(names))


_KILL_AT_EXIT = False


_NUMPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                 torch.float32, torch.float64}


def _stack_tensors(batch, *, collate_fn_map=None) -> torch.Tensor:
    """``default_collate``'s stacking of tensors, each copied into the batch by numpy, whose strided copy moves an
    image in HWC memory (what Pillow and the JPEG decoders give) into a channels-first batch several times faster
    than ``torch.stack``. The batch is torch's (contiguous; in shared memory inside a worker); other tensors go to
    torch's own function."""
    elem = batch[0]
    if (elem.layout != torch.strided or elem.is_nested or elem.device.type != "cpu" or elem.dim() == 0
            or elem.dtype not in _NUMPY_DTYPES or elem.requires_grad
            or any(t.shape != elem.shape or t.dtype != elem.dtype for t in batch)):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    if torch.utils.data.get_worker_info() is not None:  # the batch travels to the main process: shared memory
        storage = elem._typed_storage()._new_shared(len(batch) * elem.numel(), device=elem.device)
        out = elem.new(storage).resize_(len(batch), *elem.shape)
    else:
        out = torch.empty((len(batch), *elem.shape), dtype=elem.dtype)
    for row, item in zip(out.numpy(), batch):
        np.copyto(row, item.numpy())
    return out


def collate(batch):
    """``torch.utils.data.default_collate``, the same batches, with its tensors stacked by :func:`_stack_tensors`."""
    return collate_with_map(batch, collate_fn_map={**default_collate_fn_map, torch.Tensor: _stack_tensors})


def build_train_loader(dataset: Dataset, sampler: ResumableSampler, batch_size: int, num_workers: Union[int, str],
                       persistent_workers: bool = True, ignore_signals=STOP_SIGNALS) -> DataLoader:
    """Per-process training loader over a :class:`ResumableSampler`, items seeded per sample.

    The loader's own generator keeps it off the global torch RNG, so training randomness depends only on the
    per-sample seeds (not on workers, processes or resumes). Workers persist across epochs (no re-spawn and
    dataset re-pickling per epoch); the sampler still runs in the main process, so ``sampler.set_epoch`` before
    each ``iter(loader)`` selects the epoch and start position as before.
    """
    num_workers = resolve_num_workers(num_workers)
    workers = dict(persistent_workers=persistent_workers) if num_workers > 0 else {}
    return DataLoader(SeededDataset(dataset), batch_size=batch_size, sampler=sampler, drop_last=True,
                      num_workers=num_workers, pin_memory=torch.cuda.is_available(), generator=torch.Generator(),
                      worker_init_fn=ignore_in_workers(ignore_signals), collate_fn=collate, **workers)


class DevicePrefetcher:
    """Batches of ``loader`` on ``device``, the next one already moving while the current one is used.

    Every tensor of a batch (tuples and lists are walked) is copied with ``non_blocking=True``; ``transform``
    (optional) then runs on the device batch, e.g. normalisation and random erasing of uint8 images (its
    ``before_copy``, if it has one, on the host batch before the copy). On CUDA
    the copy and the transform of batch ``n + 1`` are queued on a side stream before batch ``n`` is handed out
    (what timm's ``PrefetchLoader`` does); the compute stream waits for that stream, and ``record_stream``
    tells the caching allocator that the compute stream uses the memory. On any other device it is the plain
    loop: move, transform, yield, so a CPU run computes exactly the same batches.

        feed = DevicePrefetcher(loader, accelerator.device, transform=batch_transform)
        for images, targets in feed: ...
    """

    def __init__(self, loader, device, transform: Optional[Callable] = None):
        self.loader = loader
        self.device = torch.device(device)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.loader)

    def close(self) -> None:
        """Stop the loader's persistent workers now (they ignore stop signals, so they must be told)."""
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def _prepare(self, batch):
        host_half = getattr(self.transform, "before_copy", None)  # host work the transform needs no device for
        if host_half is not None:
            batch = host_half(batch)
        batch = _to_device(batch, self.device)
        return self.transform(batch) if self.transform is not None else batch

    def __iter__(self):
        if self.device.type != "cuda":
            for batch in self.loader:
                yield self._prepare(batch)
            return
        stream = torch.cuda.Stream(self.device)
        ready = None
        for batch in self.loader:
            with torch.cuda.stream(stream):
                upcoming = self._prepare(batch)
            if ready is not None:
                yield ready
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(stream)
            _record_stream(upcoming, compute)
            ready = upcoming
        if ready is not None:
            yield ready


def _to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(b, device) for b in batch)
    return batch


def _record_stream(batch, stream) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, (tuple, list)):
        for b in batch:
            _record_stream(b, stream)
