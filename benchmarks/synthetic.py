"""Generated inputs for the benchmarks: ImageNet-like JPEG folders, DiT latent shards in
``diffusion.extract_latents``'s format, smooth colour fields for the FID benchmark, and train-step batches."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

# (width, height, weight): ImageNet's training set is dominated by 500-pixel-wide Flickr sizes
IMAGE_SIZES = ((500, 375, 6), (375, 500, 2), (500, 333, 3), (500, 500, 1), (333, 500, 1), (640, 480, 1),
               (800, 600, 1), (1024, 768, 1), (300, 225, 1))


def natural_image(width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 (H, W, 3) with a 1/f amplitude spectrum (the statistics of photographs), channels correlated."""
    fy, fx = np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None, :]
    amplitude = 1.0 / np.maximum(np.hypot(fx, fy), 1.0 / max(width, height))

    def field():
        phase = np.exp(2j * np.pi * rng.random((height, width // 2 + 1)))
        return np.fft.irfft2(amplitude * phase, s=(height, width))

    shared = field()
    x = np.stack([shared + 0.5 * field() for _ in range(3)], axis=-1)
    x = 128 + 50 * (x - x.mean()) / x.std() + rng.normal(0, 3, x.shape)
    return np.clip(x, 0, 255).astype(np.uint8)


def write_jpegs(root: Path, count: int, seed: int = 0, quality: int = 90, split: str = "train") -> float:
    """``count`` JPEGs in ``root/<split>/<class>/`` (two classes); returns the mean bytes per pixel."""
    rng = np.random.default_rng(seed)
    sizes = [(w, h) for w, h, weight in IMAGE_SIZES for _ in range(weight)]
    total_bytes = total_pixels = 0
    for i in range(count):
        w, h = sizes[i % len(sizes)]
        folder = root / split / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{i:05d}.JPEG"
        Image.fromarray(natural_image(w, h, rng)).save(path, quality=quality)
        total_bytes += path.stat().st_size
        total_pixels += w * h
    return total_bytes / total_pixels


def write_latents(root: Path, count: int, shard_size: int, latent_shape=(4, 32, 32), seed: int = 0) -> None:
    """Posterior moments in ``diffusion.extract_latents``'s format (float16, two views per image)."""
    from diffusion.extract_latents import write_metadata
    from diffusion.latents import shard_name, shard_settings, write_shard

    gen = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)
    settings = shard_settings(vae="bench", scaling_factor=0.18215, image_size=8 * latent_shape[-1], shard_size=shard_size,
                              dtype="float16", num_listed=count, classes=[f"c{i}" for i in range(1000)])
    shards = range(0, count, shard_size)
    for k, start in enumerate(shards):
        n = min(shard_size, count - start)
        mean = torch.randn(n, 2, *latent_shape, generator=gen).half()
        logvar = (torch.randn(n, 2, *latent_shape, generator=gen) - 4).half()
        write_shard(root / shard_name(k), mean, logvar, torch.randint(0, 1000, (n,), generator=gen),
                    torch.arange(start, start + n), [], settings)
    write_metadata(root, len(shards), settings, latent_shape)


def smooth_images(rng, count: int, sizes, grid: int = 6):
    """Smooth random RGB fields: bilinear upsampling of a small random grid, one size per image."""
    for i in range(count):
        h, w = sizes(i)
        coarse = torch.from_numpy(rng.uniform(0, 255, (1, 3, grid, grid)).astype(np.float32))
        image = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)[0]
        yield image.permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()


def write_png_folder(folder: Path, count: int, seed: int) -> Path:
    """``count`` 64x64 PNGs of smooth random colour fields (what both FID commands read)."""
    if not folder.exists():
        folder.mkdir(parents=True)
        for i, image in enumerate(smooth_images(np.random.default_rng(seed), count, lambda i: (64, 64))):
            Image.fromarray(image).save(folder / f"{i:06d}.png")
    return folder


def deit_batch(batch_size: int, img_size: int, num_classes: int, seed: int = 0) -> tuple:
    """Random images and labels."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch_size, 3, img_size, img_size, generator=gen),
            torch.randint(0, num_classes, (batch_size,), generator=gen))


def dit_batch(batch_size: int, latent_size: int, in_channels: int, num_classes: int, seed: int = 0) -> tuple:
    """Random latents, timesteps (of 1000), labels and target noise."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch_size, in_channels, latent_size, latent_size, generator=gen),
            torch.randint(0, 1000, (batch_size,), generator=gen),
            torch.randint(0, num_classes, (batch_size,), generator=gen),
            torch.randn(batch_size, in_channels, latent_size, latent_size, generator=gen))
