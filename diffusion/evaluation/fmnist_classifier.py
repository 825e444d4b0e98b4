"""Training the small Fashion-MNIST CNN whose features give the ``fmnist-cnn`` Frechet distance
(:class:`~diffusion.evaluation.features.FashionMNISTClassifier`); ``python -m scripts.train_fmnist_classifier`` is its
command line."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from common.checkpoint import save_weights
from common.cli import InputError
from common.data import load_fashion_mnist
from diffusion.evaluation.features import FashionMNISTClassifier, fmnist_preprocess, fmnist_weights_path


@torch.no_grad()
def accuracy(model, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 1000) -> float:
    model.eval()
    correct = sum(int((model(fmnist_preprocess(images[i: i + batch_size])).argmax(1) == labels[i: i + batch_size]).sum())
                  for i in range(0, len(images), batch_size))
    return correct / len(images)


def train_fmnist_classifier(epochs: int = 5, batch_size: int = 128, lr: float = 1e-3, seed: int = 0,
                            limit: Optional[int] = None, data_root: Optional[str] = None,
                            out: Optional[Path] = None) -> dict:
    """AdamW with cosine decay on the first ``limit`` training images; writes the weights (default: the cache,
    :func:`~diffusion.evaluation.features.fmnist_weights_path`) with the test accuracy in their metadata."""
    torch.manual_seed(seed)
    train_x, train_y = (torch.from_numpy(a.copy()) for a in load_fashion_mnist("train", data_root))
    test_x, test_y = (torch.from_numpy(a.copy()) for a in load_fashion_mnist("test", data_root))
    if limit is not None:
        train_x, train_y = train_x[:limit], train_y[:limit]
    train_x, test_x = train_x[:, None], test_x[:, None]  # uint8 [N, 1, 28, 28]

    model = FashionMNISTClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps_per_epoch = len(train_x) // batch_size
    if steps_per_epoch == 0:
        raise InputError(f"--batch-size {batch_size} is larger than the {len(train_x)} training images; "
                         "pass a smaller --batch-size or a larger --limit")
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * steps_per_epoch)
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        model.train()
        start, total = time.time(), 0.0
        order = torch.randperm(len(train_x), generator=generator)
        for step in range(steps_per_epoch):
            idx = order[step * batch_size: (step + 1) * batch_size]
            loss = F.cross_entropy(model(fmnist_preprocess(train_x[idx])), train_y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += loss.item()
        print(f"epoch {epoch + 1}/{epochs}: loss {total / steps_per_epoch:.4f} ({time.time() - start:.0f}s)")
    test_acc = accuracy(model, test_x, test_y)
    path = save_weights(model, out or fmnist_weights_path(),
                        metadata={"test_accuracy": f"{test_acc:.4f}", "epochs": epochs, "seed": seed,
                                  "train_images": len(train_x)})
    print(f"test accuracy {test_acc:.4f}; weights written to {path}")
    return {"test_accuracy": test_acc, "path": path}
