"""Chunked sample sets: samples ``0..N-1`` in chunks over any number of processes, each chunk written as it
finishes, a rerun with the same settings sampling only what is missing; then ADM's ``samples.npz`` and PNGs."""
from __future__ import annotations

import io
import json
import math
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence

import numpy as np
import torch

from common.durable import atomic_savez, atomic_write, atomic_write_text
from common.preemption import stoppable_rounds
from diffusion.sampling.options import SamplingError

if TYPE_CHECKING:
    from diffusion.sampling.sampler import Sampler

Tensor = torch.Tensor
SETTINGS_FILE = "settings.json"


def balanced_labels(indices: Tensor, num_classes: int) -> Tensor:
    """Sample ``i`` gets class ``i % num_classes``: exactly N / num_classes per class when divisible."""
    return indices % num_classes


def chunk_path(out_dir: Path, k: int) -> Path:
    return out_dir / "chunks" / f"chunk_{k:06d}.npz"


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def write_adm_npz(path: Path, chunk_files: Sequence[Path], count: int, image_shape: Sequence[int], protocol: dict) -> None:
    """``arr_0`` (uint8 [N, H, W, C]), ``arr_1`` (labels) and the protocol, streamed chunk by chunk, so the
    file can be larger than memory (np.savez needs the whole array)."""
    from diffusion.evaluation.images import SAMPLING_PROTOCOL_KEY

    labels = []
    with atomic_write(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        with zf.open("arr_0.npy", "w", force_zip64=True) as f:
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
                      "shape": (count, *image_shape)}
            np.lib.format.write_array_header_1_0(f, header)
            for chunk in chunk_files:
                with np.load(chunk) as data:
                    f.write(np.ascontiguousarray(data["images"]).tobytes())
                    labels.append(data["labels"])
        zf.writestr("arr_1.npy", _npy_bytes(np.concatenate(labels)))
        zf.writestr(f"{SAMPLING_PROTOCOL_KEY}.npy", _npy_bytes(np.array(json.dumps(protocol))))


def write_pngs(folder: Path, chunk_files: Sequence[Path], protocol: dict) -> None:
    """One PNG per sample, each written atomically; all are rewritten from the chunks (the source of truth), so
    files left by an interrupted earlier run are never trusted."""
    from PIL import Image

    from diffusion.evaluation.images import SAMPLING_PROTOCOL_FILE

    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.tmp"):  # a kill while writing a PNG leaves only its temporary file
        stale.unlink()
    for chunk in chunk_files:
        with np.load(chunk) as data:
            for index, image in zip(data["indices"], data["images"]):
                with atomic_write(folder / f"{int(index):06d}.png") as tmp:
                    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(tmp, format="PNG")
    atomic_write_text(folder / SAMPLING_PROTOCOL_FILE, json.dumps(protocol, indent=2))


def held_samples(out_dir: Path) -> List[Path]:
    """What a sample set in ``out_dir`` holds so far: its chunks, ``samples.npz`` and PNGs (the first of each)."""
    found = [next(out_dir.glob(pattern), None) for pattern in ("chunks/chunk_*.npz", "samples.npz", "images/*.png")]
    return [p for p in found if p is not None]


def check_resume(out_dir: Path, settings: dict) -> None:
    """Refuse to add samples to a directory whose samples were made otherwise (options or weights). The settings of
    a command that ended before its first chunk bind nothing: a folder without samples takes the new settings."""
    settings_file = out_dir / SETTINGS_FILE
    held = held_samples(out_dir)
    if not settings_file.is_file():
        if held:
            raise SamplingError(f"{out_dir} holds samples ({held[0].relative_to(out_dir)}) but no {SETTINGS_FILE}, so "
                                "nothing says which weights and options made them; use a new --out-dir (or delete "
                                "them)")
        return
    if not held:
        return
    old = json.loads(settings_file.read_text())
    # The weights are compared by content (weights_sha256); the path is only recorded, so a moved file resumes.
    diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k) and k != "checkpoint")
    if not diff:
        return
    if diff == ["weights_sha256"]:
        raise SamplingError(
            f"{out_dir} holds samples from other weights: {settings['checkpoint']} now holds weights with fingerprint "
            f"{settings['weights_sha256'][:16]}, the finished chunks came from {str(old['weights_sha256'])[:16]} (the "
            "file was replaced since, e.g. by a training run refreshing ema.safetensors). Use a new --out-dir, or "
            "restore the weights the chunks came from to resume")
    raise SamplingError(f"{out_dir} holds samples made with other settings ({', '.join(diff)} differ); "
                        "use a new --out-dir, or the same options to resume")


def write_sample_set(sampler: Sampler, out_dir, num_samples: int, batch_size: int, settings: dict, state,
                     formats: Sequence[str] = ("npz",), progress: bool = True,
                     stop_signals: Sequence[str] = ()) -> Optional[dict]:
    """Samples ``0..N-1`` in chunks of ``batch_size`` (process r of ``state`` takes chunks r, r + W, ...), each
    written to ``out_dir/chunks/`` as it finishes, then ``samples.npz`` (``"npz"``) and ``images/`` (``"png"``).

    ``settings`` (what makes the set, :meth:`Sampler.settings` plus the caller's) go to ``settings.json``; a rerun
    with the same settings only samples the chunks still missing, one with other settings is refused.
    ``stop_signals`` (a command line's: SIGTERM, SIGUSR1): the processes stop together after a round of one chunk
    each (:func:`common.preemption.stoppable_rounds`, which raises ``WorkStopped``), their chunks written.
    Returns ``{"outputs", "protocol"}`` on the main process, None on the others.
    """
    out_dir = Path(out_dir)
    check_resume(out_dir, settings)
    state.wait_for_everyone()
    if state.is_main_process:
        (out_dir / "chunks").mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / SETTINGS_FILE, json.dumps(settings, indent=2))
    state.wait_for_everyone()

    world, rank = state.num_processes, state.process_index
    num_chunks = math.ceil(num_samples / batch_size)
    todo = {k for k in range(rank, num_chunks, world) if not chunk_path(out_dir, k).exists()}
    from tqdm.auto import tqdm

    quiet = not state.is_main_process or not progress
    with tqdm(total=len(todo), desc=f"chunks (process {rank})", disable=quiet) as bar:
        for round_ in stoppable_rounds(math.ceil(num_chunks / world), stop_signals, world, rank, unit="chunks"):
            k = round_ * world + rank
            if k in todo:
                indices = torch.arange(k * batch_size, min((k + 1) * batch_size, num_samples))
                labels = balanced_labels(indices, sampler.spec.num_classes)
                images = sampler(indices, labels).permute(0, 2, 3, 1).numpy()  # NHWC, as ADM stores them
                atomic_savez(chunk_path(out_dir, k), images=images, labels=labels.numpy(), indices=indices.numpy())
                bar.update(1)
    state.wait_for_everyone()
    if not state.is_main_process:
        return None

    from diffusion.evaluation.images import SAMPLING_PROTOCOL_FILE

    chunks = [chunk_path(out_dir, k) for k in range(num_chunks)]
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise SamplingError(f"chunks missing after sampling ({missing[:3]}...): do all processes share {out_dir}?")
    with np.load(chunks[0]) as first:
        image_shape = first["images"].shape[1:]
    protocol = {**settings, "num_processes": state.num_processes}
    outputs = {}
    if "npz" in formats:
        outputs["npz"] = out_dir / "samples.npz"
        write_adm_npz(outputs["npz"], chunks, num_samples, image_shape, protocol)
    if "png" in formats:
        outputs["png"] = out_dir / "images"
        write_pngs(outputs["png"], chunks, protocol)
    atomic_write_text(out_dir / SAMPLING_PROTOCOL_FILE, json.dumps(protocol, indent=2))
    return {"outputs": {k: str(v) for k, v in outputs.items()}, "protocol": protocol}
