"""VAE latents for DiT: ADM center crop, the Stable Diffusion VAE, sharded posterior moments.

An extraction run (``python -m diffusion.extract_latents``) stores, for every image and its
horizontal flip, the VAE posterior's mean and log-variance (not one sample), so training can draw a
fresh latent ``scale * (mean + exp(logvar / 2) * eps)`` and a random flip at every step instead of
reusing one frozen sample per image.

On disk (``OUT/``): ``shard_00000.safetensors`` ... with tensors ``mean`` and ``logvar``
(N, 2 views, C, h, w; view 1 is the flipped image), ``label`` (N,) and ``index`` (N,, position in the
sorted file list), plus ``metadata.json`` (VAE, scaling factor, resolution, classes, count, shards,
skipped files). Shard ``k`` holds the images listed at positions ``[k*S, (k+1)*S)``, minus unreadable
files, so a shard can be recomputed alone.

Every shard also carries, in its header, the settings it was made with (the VAE, its weights' fingerprint and
**scaling factor**, the resolution, the classes, ...). :class:`LatentDataset` checks each shard against
``metadata.json`` before training, so an edited or mismatched ``metadata.json`` cannot make a run train at
another scale than the one its latents were made with.

A shard's header also holds its per-channel sums of the posterior draws (:func:`channel_sums`), from which
``metadata.json`` states the latents' per-channel mean and std (``latent_mean``, ``latent_std``:
:func:`latent_statistics`), for LightningDiT's normalisation (:class:`LatentScaling`).
"""
from __future__ import annotations

import json
import pickle
import os
import warnings
from bisect import bisect_right
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from common.cli import InputError, InputNotFoundError
from common.durable import atomic_write

DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
METADATA_FILE = "metadata.json"
FORMAT = "siamesenorm-latents-v2"  # v2: every shard records the scaling factor it was made with
# What metadata.json states and every shard's header repeats (shard_settings): they must agree.
SHARED_SETTINGS = ("vae", "vae_sha256", "scaling_factor", "image_size", "classes", "dtype")


class LatentsError(InputError):
    """Latents that cannot be trained on as they are: a damaged shard, shards that disagree with metadata.json."""


# ------------------------------------------------------------------------------------------- images
def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> float tensor (3, H, W) in [-1, 1]."""
    arr = np.asarray(image.convert("RGB"), dtype=np.float32)
    return torch.from_numpy(arr).permute(2, 0, 1) / 127.5 - 1.0


# ---------------------------------------------------------------------------------------------- VAE
class VAENotFoundError(InputNotFoundError):
    """The VAE is neither a local directory nor in the Hugging Face cache."""


def load_vae(path_or_id: str = DEFAULT_VAE, allow_download: bool = False, option: str = "--vae",
             download_flag: Optional[str] = None):
    """diffusers ``AutoencoderKL`` from a local directory (a VAE folder, or a pipeline folder with a
    ``vae/`` subfolder) or from the Hugging Face cache; downloads only when ``allow_download``.

    ``option`` is how the caller's user names the VAE (``--vae`` on a command line, ``data.autoencoder`` in a
    training config), for the error message; ``download_flag`` the caller's option that allows a download, if it
    has one."""
    from diffusers import AutoencoderKL

    return _from_vae_source(AutoencoderKL.from_pretrained, path_or_id, allow_download, option, download_flag)


def load_vae_config(path_or_id: str, option: str = "--vae") -> dict:
    """The ``config.json`` of the VAE :func:`load_vae` would load, without its weights."""
    from diffusers import AutoencoderKL

    return dict(_from_vae_source(AutoencoderKL.load_config, path_or_id, False, option, None))


def vae_downsampling(config) -> int:
    """How many pixels one latent stands for along a side: ``2 ** (blocks - 1)`` of an ``AutoencoderKL`` config
    (the SD VAE's 4 blocks: 8; LightningDiT's VA-VAE f16d32, 5 blocks: 16)."""
    blocks = config["block_out_channels"] if isinstance(config, dict) else config.block_out_channels
    return 2 ** (len(blocks) - 1)


def _from_vae_source(load, path_or_id: str, allow_download: bool, option: str, download_flag: Optional[str]):
    """``load(...)`` (diffusers' ``from_pretrained`` or ``load_config``) of a VAE folder, a pipeline folder's
    ``vae/``, or a cached Hugging Face id; one line naming ``option`` when there is none."""
    path = Path(path_or_id).expanduser()
    try:
        if path.is_dir():
            subfolder = "vae" if not (path / "config.json").exists() and (path / "vae" / "config.json").exists() else None
            return load(str(path), subfolder=subfolder, local_files_only=True)
        if path_or_id.startswith((".", "/", "~")) or path_or_id.count("/") > 1:  # a path, not a hub id
            raise OSError(f"directory {path} does not exist")
        with warnings.catch_warnings():  # diffusers still passes an argument huggingface_hub >= 1 ignores
            warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks.*")
            return load(path_or_id, local_files_only=not allow_download)
    except (OSError, ValueError) as err:
        from huggingface_hub.constants import HF_HUB_CACHE

        where = f"directory {path}" if path.is_dir() else f"neither a local directory nor in the Hugging Face cache {HF_HUB_CACHE}"
        given = f"{option}=DIR" if option.startswith(("data.", "train.")) else f"{option} DIR"
        download = f"; {download_flag} fetches it when this machine has internet" if download_flag else ""
        raise VAENotFoundError(
            f"cannot load the VAE {path_or_id!r}: {where} ({str(err).splitlines()[0]}). Provide it with {given}, a "
            "directory holding config.json and diffusion_pytorch_model.safetensors (on a machine with internet: "
            f"`hf download {DEFAULT_VAE} --local-dir sd-vae-ft-ema`, then copy the folder here), or place it in the "
            f"Hugging Face cache (HF_HOME) and pass its id{download}."
        ) from err


@torch.no_grad()
def encode_moments(vae, images: torch.Tensor):
    """Posterior mean and log-variance of ``images`` (B, 3, H, W in [-1, 1]) and of their horizontal
    flips, each (B, 2, C, h, w) with view 1 the flip."""
    both = torch.cat([images, images.flip(-1)])
    dist = vae.encode(both).latent_dist
    b = images.shape[0]
    stack = lambda t: torch.stack([t[:b], t[b:]], dim=1)  # noqa: E731
    return stack(dist.mean), stack(dist.logvar)


class LatentScaling:
    """What training does to a VAE latent ``z`` and sampling undoes before the decoder: the VAE's scaling factor,
    ``f z`` (DiT's 0.18215); or, with ``norm`` (``{"mean", "std", "multiplier"}``, the per-channel statistics
    :func:`latent_statistics` gives), LightningDiT's normalisation ``(z - mean_c) / std_c * multiplier``, undone
    as its inference.py does, ``x * std_c / multiplier + mean_c``."""

    def __init__(self, scaling_factor: float, norm: Optional[dict] = None):
        self.scaling_factor, self.norm = float(scaling_factor), norm
        if norm is not None:
            self.mean = torch.tensor(norm["mean"], dtype=torch.float32).view(-1, 1, 1)
            self.std = torch.tensor(norm["std"], dtype=torch.float32).view(-1, 1, 1)
            self.multiplier = float(norm["multiplier"])

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """A VAE latent ``(..., C, h, w)`` -> what the DiT trains on."""
        if self.norm is None:
            return self.scaling_factor * z
        return (z - self.mean.to(z)) / self.std.to(z) * self.multiplier

    def undo(self, x: torch.Tensor) -> torch.Tensor:
        """What the DiT samples -> the VAE latent its decoder takes."""
        if self.norm is None:
            return x / self.scaling_factor
        return x * self.std.to(x) / self.multiplier + self.mean.to(x)


def read_latent_stats(path, multiplier: float = 1.0) -> dict:
    """LightningDiT's normalisation of a model's latents, ``{"mean", "std", "multiplier"}``, from its
    ``latents_stats.pt`` (``{"mean", "std"}`` tensors of shape ``(1, C, 1, 1)``) or an extraction's
    ``metadata.json`` (``latent_mean``, ``latent_std``): what ``diffusion.sample --latent-stats`` undoes before decoding
    LightningDiT's own checkpoints, which record none."""
    path = Path(path)
    try:
        if path.suffix == ".json":
            meta = json.loads(path.read_text())
            mean, std = meta["latent_mean"], meta["latent_std"]
        else:
            stats = torch.load(path, map_location="cpu", weights_only=True)
            mean, std = stats["mean"].flatten().tolist(), stats["std"].flatten().tolist()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError, pickle.UnpicklingError) as err:
        raise InputError(f"--latent-stats {path}: not LightningDiT's latents_stats.pt ({{'mean', 'std'}} tensors) or an "
                         f"extraction's metadata.json with latent_mean and latent_std ({type(err).__name__}: {err})") from None
    if mean is None or std is None or len(mean) != len(std):
        raise InputError(f"--latent-stats {path}: its mean and std give {len(mean or [])} and {len(std or [])} channels")
    return {"mean": [float(v) for v in mean], "std": [float(v) for v in std], "multiplier": float(multiplier)}


def latent_from_moments(mean: torch.Tensor, logvar: torch.Tensor, noise: torch.Tensor,
                        scale: Union[float, LatentScaling]) -> torch.Tensor:
    """A draw from the posterior, scaled: ``scale * (mean + exp(logvar / 2) * noise)`` (a :class:`LatentScaling`:
    its :meth:`~LatentScaling.apply` of the draw)."""
    scaling = scale if isinstance(scale, LatentScaling) else LatentScaling(scale)
    return scaling.apply(mean + torch.exp(0.5 * logvar) * noise)


def draw_latent(moments: "LatentDataset", i: int, hflip: bool = True, with_image: bool = False,
                scaling: Optional[LatentScaling] = None):
    """A fresh training latent of image ``i`` and its label: ``(latent (C, h, w), label)``; ``with_image`` appends the
    stored pixels of the same view (uint8 (3, S, S), mirrored with the latent). ``scaling``: the VAE's scaling factor
    the latents record unless given (LightningDiT's normalisation, :class:`LatentScaling`).

    Draws the flip (view 1, the mirror, with probability 1/2 when ``hflip``), reads only that view's moments
    (:meth:`LatentDataset.read_view`, half the bytes), then draws the noise: the same torch draws in the same
    order as reading both views and choosing one, so a given
    seed gives the same latent either way.
    """
    flip = bool(torch.rand(1) < 0.5) if hflip else False
    mean, logvar, label = moments.read_view(i, int(flip))
    noise = torch.randn(mean.shape)
    latent = latent_from_moments(mean, logvar, noise, scaling or moments.scaling_factor)
    return (latent, label, moments.read_image(i, int(flip))) if with_image else (latent, label)


# ------------------------------------------------------------------------------------ per-channel statistics
CHANNEL_SUMS = "channel_sums"  # the shard header entry of :func:`channel_sums`


def channel_sums(mean: torch.Tensor, logvar: torch.Tensor) -> dict:
    """A shard's share of the latents' per-channel statistics: over its posteriors ``(N, 2 views, C, h, w)`` and
    every position, the count of draws per channel and, in float64, the sums of their expectation ``E z = mean``
    and of their second moment ``E z^2 = mean^2 + exp(logvar)``."""
    mean, var = mean.double(), logvar.double().exp()
    dims = (0, 1, 3, 4)
    return {"count": mean.numel() // mean.shape[2] if mean.numel() else 0, "sum": mean.sum(dims).tolist(),
            "sum_sq": (mean ** 2 + var).sum(dims).tolist()}


def latent_statistics(shard_sums: Sequence[dict]) -> Tuple[Optional[list], Optional[list]]:
    """``(mean, std)`` per channel of the posterior draws of every latent (both views), from the shards'
    :func:`channel_sums`: the mean of ``E z`` and ``sqrt(E z^2 - mean^2)`` (the law of total variance: the spread of
    the posterior means plus the posteriors' own variance). ``(None, None)`` without any latent."""
    count = sum(s["count"] for s in shard_sums)
    if count == 0:
        return None, None
    first = np.sum([s["sum"] for s in shard_sums if s["count"]], axis=0) / count
    second = np.sum([s["sum_sq"] for s in shard_sums if s["count"]], axis=0) / count
    return first.tolist(), np.sqrt(np.maximum(second - first ** 2, 0.0)).tolist()


# ------------------------------------------------------------------------------------------- shards
def shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


def read_metadata(root: Union[str, os.PathLike]) -> dict:
    path = Path(root) / METADATA_FILE
    if not path.is_file():
        raise InputNotFoundError(
            f"{path} not found: {root} is not a finished latent extraction. Run "
            "`python -m diffusion.extract_latents --data-path IMAGES --out DIR` (it resumes where it stopped)."
        )
    try:
        meta = json.loads(path.read_text())
    except ValueError as err:
        raise LatentsError(f"{path} is not valid JSON ({err}); re-run the extraction into {root} to write it "
                           "again") from None
    if meta.get("format") != FORMAT:
        why = (" (its shards do not record the VAE scaling factor they were made with, so a run cannot check it)"
               if meta.get("format") == "siamesenorm-latents-v1" else "")
        raise LatentsError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}{why}; extract the latents "
                           "again into a new --out with this version of `python -m diffusion.extract_latents`")
    return meta


def rerun_hint(root: Path, meta: dict) -> str:
    """How to rewrite what is damaged: the extraction that made the latents, run again (it redoes unreadable
    shards only)."""
    return (f"re-run the extraction that made them (`python -m diffusion.extract_latents --data-path IMAGES --vae "
            f"{meta.get('vae')} --image-size {meta.get('image_size')} --dtype {meta.get('dtype')} --out {root}`, with "
            "its --shard-size): it rewrites the damaged shards only")


class LatentDataset(Dataset):
    """Stored latent moments, one item per image: ``(mean, logvar, label)`` with mean/logvar
    (2 views, C, h, w) float32. Draw the training latent with :func:`draw_latent`.

    Shards are memory-mapped (safetensors) and read one row at a time, so the dataset does not need
    to fit in memory.
    """

    def __init__(self, root: Union[str, os.PathLike]):
        from safetensors import safe_open

        self.root = Path(root)
        self.metadata = meta = read_metadata(root)
        self.scaling_factor = float(meta["scaling_factor"])
        self.classes = list(meta["classes"])
        listed = [s for s in meta["shards"] if s["count"] > 0]
        self.files = [self.root / s["file"] for s in listed]
        counts, labels, sums = [], [], []
        for f, entry in zip(self.files, listed):
            if not f.is_file():
                raise InputNotFoundError(f"{f} listed in {self.root / METADATA_FILE} is missing; "
                                         f"{rerun_hint(self.root, meta)}")
            try:
                with safe_open(str(f), framework="pt") as h:
                    settings = h.metadata() or {}
                    labels.append(h.get_tensor("label"))
            except Exception as err:  # noqa: BLE001 -- safetensors' SafetensorError, an OSError, ...: the file is bad
                detail = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise LatentsError(f"{f} is damaged or truncated ({detail}); {rerun_hint(self.root, meta)}") from None
            self._check_shard(f, settings, len(labels[-1]), entry["count"])
            counts.append(len(labels[-1]))
            sums.append(json.loads(settings[CHANNEL_SUMS]) if CHANNEL_SUMS in settings else None)
        self._check_statistics(sums)
        self.labels = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long)
        self.offsets = np.cumsum([0] + counts).tolist()
        self._handles: dict = {}

    def _check_shard(self, path: Path, settings: dict, count: int, listed: int) -> None:
        """A shard must have been made with what metadata.json states (above all its scaling factor: training
        multiplies every latent by it) and hold the count listed there."""
        meta = self.metadata
        for key in SHARED_SETTINGS:
            made_with = json.loads(settings[key]) if key in settings else None
            if made_with != meta.get(key):
                shown = (lambda v: f"{len(v)} classes" if isinstance(v, list) else repr(v))  # noqa: E731
                raise LatentsError(
                    f"{self.root / METADATA_FILE} says {key} {shown(meta.get(key))} but {path.name} was made with "
                    f"{shown(made_with)}: the metadata was edited or belongs to another extraction, and training "
                    f"would use the wrong values (a latent is scaled by scaling_factor). Restore metadata.json (re-run "
                    f"the extraction into {self.root} rewrites it from the shards), or extract again into a new --out")
        if count != listed:
            raise LatentsError(f"{path} holds {count} latents, {self.root / METADATA_FILE} lists {listed}: they belong "
                               f"to different extractions; {rerun_hint(self.root, meta)}")

    def _check_statistics(self, shard_sums: Sequence[Optional[dict]]) -> None:
        """The per-channel statistics metadata.json states must be those of its shards (a normalised run trains on
        them); shards extracted before their sums were recorded are not checked."""
        meta = self.metadata
        if meta.get("latent_mean") is None or not shard_sums or None in shard_sums:
            return
        mean, std = latent_statistics(shard_sums)
        if (mean, std) != (meta["latent_mean"], meta["latent_std"]):
            raise LatentsError(f"{self.root / METADATA_FILE} states other per-channel latent statistics than its "
                               f"shards give (latent_mean {meta['latent_mean'][:2]}... vs {mean[:2]}...): it was edited "
                               f"or belongs to another extraction, and data.latent_norm would normalise with them. "
                               f"Restore metadata.json (re-running the extraction into {self.root} rewrites it from "
                               "the shards), or extract again into a new --out")

    def normalization(self, multiplier: float) -> dict:
        """LightningDiT's ``latent_norm`` of these latents: their per-channel ``mean`` and ``std`` (metadata.json)
        and ``multiplier``, as :class:`LatentScaling` and a model's description take it."""
        meta = self.metadata
        if meta.get("latent_mean") is None:
            raise LatentsError(f"data.latent_norm needs the latents' per-channel statistics, which "
                               f"{self.root / METADATA_FILE} lacks (extracted before they were recorded): re-run the "
                               f"extraction that made them into {self.root} (it computes them from the shards without "
                               "encoding again), or set data.latent_norm=false")
        return {"mean": meta["latent_mean"], "std": meta["latent_std"], "multiplier": float(multiplier)}

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"] = {}  # mmaps are reopened in each worker
        return state

    def _handle(self, shard: int):
        if shard not in self._handles:
            from safetensors import safe_open

            self._handles[shard] = safe_open(str(self.files[shard]), framework="pt")
        return self._handles[shard]

    def _locate(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} latents")
        shard = bisect_right(self.offsets, i) - 1
        return self._handle(shard), i - self.offsets[shard]

    def __getitem__(self, i: int):
        h, row = self._locate(i)
        mean = h.get_slice("mean")[row : row + 1][0].float()
        logvar = h.get_slice("logvar")[row : row + 1][0].float()
        return mean, logvar, int(self.labels[i])

    def read_view(self, i: int, view: int):
        """``(mean, logvar, label)`` of one view only (0: the image, 1: its mirror), each (C, h, w) float32;
        reads half the bytes of ``self[i]``."""
        if view not in (0, 1):
            raise ValueError(f"view {view}; 0 is the image, 1 its mirror")
        h, row = self._locate(i)
        mean = h.get_slice("mean")[row : row + 1, view : view + 1][0, 0].float()
        logvar = h.get_slice("logvar")[row : row + 1, view : view + 1][0, 0].float()
        return mean, logvar, int(self.labels[i])

    def read_image(self, i: int, view: int) -> torch.Tensor:
        """The stored center-cropped image of ``i`` (``--images``), mirrored for view 1: uint8 (3, S, S)."""
        if not self.metadata.get("images"):
            raise LatentsError(f"the latents in {self.root} hold no images, and REPA's encoder reads the pixels each "
                               "latent came from: extract them again with --images (into a new --out), or set "
                               "repa.weight=0 to train without REPA")
        h, row = self._locate(i)
        image = h.get_slice("image")[row : row + 1][0]
        return image.flip(-1) if view else image


def shard_settings(**settings) -> dict:
    """Extraction settings stored in every shard; a resumed run must use the same ones."""
    return {k: json.dumps(v) for k, v in sorted(settings.items())}


def write_shard(path: Path, mean, logvar, labels, indices, skipped: Sequence[str], settings: dict,
                images: Optional[torch.Tensor] = None) -> None:
    """Write one shard atomically (temporary file, then rename), so a killed run leaves no half shard. ``images``
    (uint8, N x 3 x S x S), if given, are stored as tensor ``image``."""
    from safetensors.torch import save_file

    c, h, w = mean.shape[-3:]
    tensors = {
        "mean": mean.contiguous() if len(mean) else torch.zeros(0, 2, c, h, w, dtype=mean.dtype),
        "logvar": logvar.contiguous() if len(logvar) else torch.zeros(0, 2, c, h, w, dtype=logvar.dtype),
        "label": torch.as_tensor(labels, dtype=torch.long),
        "index": torch.as_tensor(indices, dtype=torch.long),
    }
    if images is not None:
        tensors["image"] = images.contiguous()
    sums = channel_sums(tensors["mean"], tensors["logvar"])
    meta = dict(settings, skipped=json.dumps(list(skipped)), **{CHANNEL_SUMS: json.dumps(sums)})
    with atomic_write(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def read_shard_header(path: Path) -> Optional[dict]:
    """Settings, count, skipped files and :func:`channel_sums` (None in shards written before they were recorded) of
    a finished shard; ``None`` if absent or unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as h:
            meta = h.metadata() or {}
            count = h.get_slice("label").get_shape()[0]
    except Exception:  # noqa: BLE001 -- any unreadable shard is simply recomputed
        return None
    skipped = json.loads(meta.pop("skipped", "[]"))
    sums = meta.pop(CHANNEL_SUMS, None)
    return {"settings": meta, "count": count, "skipped": skipped, "channel_sums": json.loads(sums) if sums else None}


def stored_channel_sums(path: Path) -> dict:
    """:func:`channel_sums` of a shard read in full (one whose header does not record them)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return channel_sums(tensors["mean"], tensors["logvar"])
