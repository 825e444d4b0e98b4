"""Encode an ImageFolder into VAE latent moments for DiT training.

    python -m diffusion.extract_latents --data-path IMAGENET/train --vae PATH_OR_ID --out DIR
    accelerate launch -m diffusion.extract_latents --data-path ... --out DIR     # several GPUs

Each image is ADM-center-cropped, encoded with its horizontal flip by a diffusers ``AutoencoderKL`` (any
downsampling and channel count: the SD VAE's 8x and 4 channels, LightningDiT's VA-VAE's 16x and 32), and the
posterior mean and log-variance of both views are written to shards of ``--shard-size`` images (layout in
:mod:`diffusion.latents`); ``metadata.json`` also states the latents' per-channel mean and std, which
``data.latent_norm`` (LightningDiT's normalisation) trains with. Shards already on disk are skipped, so re-running the
same command resumes an interrupted run. Unreadable images are reported by name and skipped.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Optional

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm import tqdm

from common.checkpoint import weights_fingerprint
from common.cli import ArgumentParser, InputError, InputNotFoundError, one_line_errors
from common.data import ImageFolderError, center_crop_arr, resolve_num_workers
from common.image_sets import FORMATS, FolderImages, open_encoded, open_image_set
from common.distributed import cuda_available, use_fast_cuda_kernels
from common.durable import atomic_write_text
from common.preemption import command_stop_signals, exit_when_stopped, stoppable_rounds
from diffusion.latents import (
    DEFAULT_VAE,
    FORMAT,
    METADATA_FILE,
    encode_moments,
    image_to_tensor,
    latent_statistics,
    load_vae,
    read_shard_header,
    shard_name,
    shard_settings,
    stored_channel_sums,
    vae_downsampling,
    write_shard,
)

class ExtractionError(InputError):
    """The output directory does not fit this run (foreign shards, missing shards)."""


STORE_DTYPES = {"float16": torch.float16, "float32": torch.float32}


class ImageFiles(Dataset):
    """The images of an ImageFolder (its sorted file list), WebDataset tars or a Hugging Face dataset
    (:mod:`common.image_sets`); an item is ``(image or None, label, index, name, error)`` so that one unreadable image
    costs one skipped image, not the run."""

    def __init__(self, root: str, image_size: int, data_format: str = "imagefolder", split: Optional[str] = None):
        self.root = Path(root)
        if data_format == "imagefolder":
            if not self.root.is_dir():
                raise InputNotFoundError(f"--data-path {root} is not a directory")
            try:
                self.images = FolderImages(self.root)
            except ImageFolderError as err:
                raise ImageFolderError(f"{root} is not an ImageFolder: {err}; it must hold one subfolder per class "
                                       "with the images inside, e.g. IMAGENET/train/n01440764/*.JPEG (shards: "
                                       "--data-format)") from None
        else:
            self.images = open_image_set(data_format, root, split)
        self.classes = self.images.classes
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        label = int(self.images.labels[i])
        try:
            with Image.open(open_encoded(self.images.read(i))) as image:
                image = image.convert("RGB")  # decodes now, so a truncated file fails here
            return image_to_tensor(center_crop_arr(image, self.image_size)), label, i, None, None
        except Exception as err:  # noqa: BLE001 -- PIL raises many types for broken files
            name = self.images.name(i)
            if isinstance(self.images, FolderImages):
                name = os.path.relpath(name, self.root)
            return None, label, i, name, f"{type(err).__name__}: {err}"


def collate(items):
    good = [it for it in items if it[0] is not None]
    images = torch.stack([it[0] for it in good]) if good else None
    return images, [it[1] for it in good], [it[2] for it in good], [(it[3], it[4]) for it in items if it[0] is None]


def parse_args(argv=None):
    p = ArgumentParser(
        prog="python -m diffusion.extract_latents",
        description="Encode an ImageFolder into VAE latent moments (image and horizontal flip) for DiT training. "
        "Resumable: re-run the same command after an interruption. Several GPUs: accelerate launch -m "
        "diffusion.extract_latents ...",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data-path", required=True, help="ImageFolder root (one subfolder per class), e.g. "
                   "IMAGENET/train; or its shards (--data-format)")
    p.add_argument("--data-format", choices=FORMATS, default="imagefolder", help="how --data-path stores the images: "
                   "class folders, WebDataset tars or a Hugging Face dataset (python -m vision.shard converts)")
    p.add_argument("--split", default=None, help="hf: the split of a DatasetDict folder or of a Hub dataset (default: "
                   "train)")
    p.add_argument("--out", required=True, help="output directory for the shards and metadata.json")
    p.add_argument("--vae", default=DEFAULT_VAE, help="local AutoencoderKL directory, or a Hugging Face id in your cache")
    p.add_argument("--allow-download", action="store_true", help="let diffusers download the VAE if it is not cached")
    p.add_argument("--image-size", type=int, default=256, help="ADM center-crop resolution, a multiple of the VAE's "
                   "downsampling (2^(blocks - 1): 8 for the SD VAE, 16 for LightningDiT's VA-VAE)")
    p.add_argument("--batch-size", type=int, default=64, help="images per VAE forward (x2 with the flips), per process")
    p.add_argument("--shard-size", type=int, default=10000, help="images per shard (the unit of resume)")
    p.add_argument("--num-workers", default="auto", help="image-decoding worker processes per process; auto: the "
                   "CPUs of this machine / its processes - 1")
    p.add_argument("--dtype", choices=sorted(STORE_DTYPES), default="float16", help="storage precision of the moments")
    p.add_argument("--images", action="store_true", help="also store each center-cropped image (uint8, 3 x S x S: "
                   "192 KiB at 256 px, 252 GB for ImageNet-1k) for REPA's encoder, which must see the pixels the latent "
                   "came from (docs/dit.md)")
    args = p.parse_args(argv)
    for name in ("image_size", "batch_size", "shard_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.num_workers != "auto" and not args.num_workers.isdigit():
        p.error(f"--num-workers {args.num_workers}: a number of worker processes >= 0, or auto")
    return args


def finished_shards(out: Path, shards, settings: dict):
    """The shards of ``shards`` already written with the same settings; refuses foreign shards."""
    done = set()
    for k in shards:
        header = read_shard_header(out / shard_name(k))
        if header is None:
            continue
        if header["settings"] != settings:
            diff = {key: (header["settings"].get(key), value) for key, value in settings.items() if header["settings"].get(key) != value}
            if set(diff) == {"vae_sha256"} and "vae_sha256" in header["settings"]:
                raise ExtractionError(
                    f"{out / shard_name(k)} was encoded by other VAE weights than --vae {json.loads(settings['vae'])} "
                    f"holds now (sha256 {json.loads(header['settings']['vae_sha256'])[:16]} then, "
                    f"{json.loads(settings['vae_sha256'])[:16]} now: the VAE was replaced in place); restore that VAE "
                    "to resume, or choose a new --out")
            raise ExtractionError(
                f"{out / shard_name(k)} was written with other settings (stored vs now: {diff}); "
                "re-run with the same options or choose a new --out"
            )
        done.add(k)
    return done


def write_metadata(out: Path, num_shards: int, settings: dict, latent_shape) -> dict:
    """``metadata.json`` from the shards on disk and the settings every shard records (which must agree)."""
    shards, skipped, sums = [], [], []
    for k in range(num_shards):
        header = read_shard_header(out / shard_name(k))
        if header is None:
            raise ExtractionError(f"{out / shard_name(k)} is missing after extraction; re-run the command to finish it")
        shards.append({"file": shard_name(k), "count": header["count"]})
        skipped += header["skipped"]
        sums.append(header["channel_sums"] or stored_channel_sums(out / shard_name(k)))
    latent_mean, latent_std = latent_statistics(sums)
    meta = {
        "format": FORMAT,
        "vae": json.loads(settings["vae"]),
        "vae_sha256": json.loads(settings.get("vae_sha256", "null")),
        "scaling_factor": json.loads(settings["scaling_factor"]),
        "image_size": json.loads(settings["image_size"]),
        "latent_shape": list(latent_shape),
        "latent_mean": latent_mean,  # per channel, over every posterior draw (both views): data.latent_norm's
        "latent_std": latent_std,
        "dtype": json.loads(settings["dtype"]),
        "views": ["image", "hflip"],
        "images": json.loads(settings.get("images", "false")),
        "classes": json.loads(settings["classes"]),
        "count": sum(s["count"] for s in shards),
        "num_listed": json.loads(settings["num_listed"]),
        "shards": shards,
        "skipped": skipped,
    }
    atomic_write_text(out / METADATA_FILE, json.dumps(meta, indent=1))
    return meta


def extract(args) -> dict:
    from accelerate import Accelerator

    files = ImageFiles(args.data_path, args.image_size, args.data_format, args.split)  # the input first
    if len(files) == 0:
        raise InputNotFoundError(f"no images found under {args.data_path}")
    accelerator = Accelerator(cpu=not cuda_available())  # cpu=True joins a gloo group under torchrun
    rank, world = accelerator.process_index, accelerator.num_processes
    vae = load_vae(args.vae, allow_download=args.allow_download, download_flag="--allow-download")
    factor = vae_downsampling(vae.config)
    if args.image_size % factor:
        raise ExtractionError(f"--image-size {args.image_size} is not a multiple of {factor}, the downsampling of --vae "
                              f"{args.vae} (2^(blocks - 1)): choose a multiple of {factor}")
    vae_sha256 = weights_fingerprint(vae.state_dict())  # a VAE replaced at the same path must not resume
    vae = vae.to(accelerator.device).eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scaling_factor = float(getattr(vae.config, "scaling_factor", 0.18215))  # recorded in every shard
    settings = shard_settings(
        vae=args.vae, vae_sha256=vae_sha256, scaling_factor=scaling_factor, image_size=args.image_size,
        shard_size=args.shard_size, dtype=args.dtype, num_listed=len(files), classes=files.classes,
        **({"images": True} if args.images else {}),
    )
    num_shards = math.ceil(len(files) / args.shard_size)
    mine = list(range(rank, num_shards, world))
    todo = [k for k in mine if k not in finished_shards(out, mine, settings)]
    accelerator.print(
        f"{len(files)} images in {len(files.classes)} classes -> {num_shards} shards of {args.shard_size} "
        f"over {world} process(es); process 0 has {len(mine) - len(todo)} of its {len(mine)} shards done already"
    )

    latent_hw = args.image_size // factor
    latent_shape = (vae.config.latent_channels, latent_hw, latent_hw)
    store = STORE_DTYPES[args.dtype]
    bar = tqdm(
        total=sum(min(args.shard_size, len(files) - k * args.shard_size) for k in todo),
        desc=f"encode[{rank}]", unit="img", disable=not accelerator.is_local_main_process, dynamic_ncols=True,
    )
    for round_ in stoppable_rounds(math.ceil(num_shards / world), args.stop_signals, world, rank, unit="shards"):
        k = round_ * world + rank
        if k not in todo:
            continue
        subset = Subset(files, range(k * args.shard_size, min((k + 1) * args.shard_size, len(files))))
        loader = DataLoader(subset, batch_size=args.batch_size, num_workers=resolve_num_workers(args.num_workers),
                            collate_fn=collate)
        means, logvars, labels, indices, skipped, pixels = [], [], [], [], [], []
        for images, batch_labels, batch_indices, bad in loader:
            for name, err in bad:
                tqdm.write(f"skipping unreadable image {name}: {err}", file=sys.stderr)
                skipped.append(name)
            if images is not None:
                mean, logvar = encode_moments(vae, images.to(accelerator.device))
                means.append(mean.to(store).cpu())
                if args.images:  # the exact uint8 pixels the VAE saw: image_to_tensor is x / 127.5 - 1
                    pixels.append(images.add(1.0).mul(127.5).round().to(torch.uint8))
                logvars.append(logvar.to(store).cpu())
                labels += batch_labels
                indices += batch_indices
            bar.update(len(batch_indices) + len(bad))
        empty = torch.zeros(0, 2, *latent_shape, dtype=store)
        write_shard(
            out / shard_name(k), torch.cat(means) if means else empty, torch.cat(logvars) if logvars else empty,
            labels, indices, skipped, settings,
            images=(torch.cat(pixels) if pixels else torch.zeros(0, 3, args.image_size, args.image_size,
                                                                 dtype=torch.uint8)) if args.images else None,
        )
    bar.close()
    accelerator.wait_for_everyone()
    meta = None
    if accelerator.is_main_process:
        meta = write_metadata(out, num_shards, settings, latent_shape)
        print(f"wrote {meta['count']} latents ({len(meta['skipped'])} unreadable images skipped) to {out}")
    accelerator.wait_for_everyone()
    return meta


def main(argv=None):
    """``argv=None`` reads the process's own command line: a stop signal (SIGTERM, SIGUSR1) then ends the extraction
    after its current round of shards with exit 4, which a job script requeues on, and the same command continues."""
    args = parse_args(argv)
    args.stop_signals = command_stop_signals(argv)
    use_fast_cuda_kernels()  # the VAE encoder's convolutions: cudnn's autotuner
    with one_line_errors(ExtractionError), exit_when_stopped():
        return extract(args)


if __name__ == "__main__":
    main()
