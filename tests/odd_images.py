"""A small image folder with the oddities of a real photo collection, for data-pipeline tests.

Sizes from 1x1 to 61x45, extreme aspect ratios, and every storage the loaders meet: RGB/grayscale/CMYK/
progressive/EXIF-rotated JPEG, PNG in RGBA, P (with transparency), LA, 1-bit and 16-bit, PNG bytes under a
``.JPEG`` name, WebP, BMP and TIFF (the extensions ImageFolder lists).
"""
import io

import numpy as np
from PIL import Image

SIZES = [(1, 1), (1, 9), (9, 1), (2, 3), (5, 40), (40, 5), (16, 16), (23, 17), (61, 45), (31, 58)]


def _save(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _variants(rgb: Image.Image):
    """(name, file bytes) of one picture stored in every way."""
    exif = rgb.getexif()
    exif[0x0112] = 6  # orientation: rotate 90
    palette = rgb.convert("P")
    yield "rgb.JPEG", _save(rgb, "JPEG", quality=90)
    yield "gray.JPEG", _save(rgb.convert("L"), "JPEG")
    yield "cmyk.JPEG", _save(rgb.convert("CMYK"), "JPEG")
    yield "progressive.JPEG", _save(rgb, "JPEG", quality=75, progressive=True)
    yield "exif.JPEG", _save(rgb, "JPEG", exif=exif.tobytes())
    yield "png_under_jpeg_name.JPEG", _save(rgb, "PNG")
    yield "rgba.png", _save(rgb.convert("RGBA"), "PNG")
    yield "palette.png", _save(palette, "PNG", transparency=0)
    yield "la.png", _save(rgb.convert("LA"), "PNG")
    yield "bilevel.png", _save(rgb.convert("1"), "PNG")
    yield "sixteen.png", _save(Image.fromarray(np.asarray(rgb.convert("L")).astype(np.uint16) * 257), "PNG")
    yield "photo.webp", _save(rgb, "WEBP")
    yield "photo.bmp", _save(rgb, "BMP")
    yield "photo.tiff", _save(rgb, "TIFF")


def write_odd_images(root, classes=("a", "b"), seed: int = 0):
    """``root/<class>/<size>_<variant>``; returns the file paths. Each size appears in every storage."""
    rng = np.random.default_rng(seed)
    paths = []
    for k, (w, h) in enumerate(SIZES):
        folder = root / classes[k % len(classes)]
        folder.mkdir(parents=True, exist_ok=True)
        ramp = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
        rgb = Image.fromarray(np.clip(ramp + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8))
        for name, data in _variants(rgb):
            path = folder / f"{w}x{h}_{name}"
            path.write_bytes(data)
            paths.append(path)
    return paths
