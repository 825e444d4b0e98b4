"""Sample grids people can read: tiles upscaled, class names written on them."""
from __future__ import annotations

import math
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from common.durable import atomic_write

Tensor = torch.Tensor


def class_names(num_classes: int, pixel: bool = False, names: Optional[Sequence[str]] = None) -> List[str]:
    """Readable class names for grid labels: ImageNet's descriptions for its 1000 classes (or for WordNet ids such as
    ``n01440764``), Fashion-MNIST's for a 10-class pixel model, else the given names or the class numbers.
    A name ImageNet-1k does not know (an ImageNet-21k WordNet id, any folder name) stays as it is."""
    from timm.data import ImageNetInfo

    if names is not None and len(names) == num_classes:
        info = ImageNetInfo()

        def readable(name: str) -> str:
            try:
                return info.label_name_to_description(name).split(",")[0]
            except KeyError:
                return name

        return [readable(str(n)) for n in names]
    if num_classes == 1000:
        info = ImageNetInfo()
        return [info.index_to_description(i).split(",")[0] for i in range(1000)]
    if num_classes == 10 and pixel:
        from common.data import FASHION_MNIST_CLASSES

        return list(FASHION_MNIST_CLASSES)
    return [str(i) for i in range(num_classes)]


def write_grid(images: Tensor, labels: Sequence[int], path, names: Sequence[str], nrow: Optional[int] = None,
               min_tile: int = 128) -> Path:
    """A PNG grid people can read: tiles upscaled (nearest, by a whole factor) to at least ``min_tile`` pixels, and
    class names written on it -- at the left of each row when a row holds one class, else under each tile."""
    from PIL import Image, ImageDraw, ImageFont

    images = images.permute(0, 2, 3, 1).numpy()  # uint8 NHWC
    n, h, w, c = images.shape
    nrow = nrow or math.ceil(math.sqrt(n))
    rows = [list(range(i, min(i + nrow, n))) for i in range(0, n, nrow)]
    scale = max(1, math.ceil(min_tile / max(h, w)))
    th, tw, pad = h * scale, w * scale, 4
    font = ImageFont.load_default(size=14)
    text = lambda i: names[int(labels[i])]  # noqa: E731
    by_row = all(len({int(labels[i]) for i in row}) == 1 for row in rows) and len(rows) > 1
    margin = max(int(font.getlength(text(row[0]))) for row in rows) + 2 * pad if by_row else 0
    caption = 0 if by_row else 18
    grid = Image.new("RGB", (margin + nrow * (tw + pad) + pad, len(rows) * (th + pad + caption) + pad), "white")
    draw = ImageDraw.Draw(grid)
    for r, row in enumerate(rows):
        y = pad + r * (th + pad + caption)
        if by_row:
            draw.text((pad, y + th // 2), text(row[0]), fill="black", font=font, anchor="lm")
        for k, i in enumerate(row):
            x = margin + pad + k * (tw + pad)
            tile = Image.fromarray(images[i][..., 0] if c == 1 else images[i]).convert("RGB")
            grid.paste(tile.resize((tw, th), Image.NEAREST), (x, y))
            if not by_row:
                label = text(i)
                while font.getlength(label) > tw and len(label) > 1:
                    label = label[:-1]
                draw.text((x + tw // 2, y + th + 2), label, fill="black", font=font, anchor="mt")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        grid.save(tmp, format="PNG")
    return path
