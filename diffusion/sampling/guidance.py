"""Classifier-free guidance in the official DiT convention: one batched forward of ``[conditional; unconditional]``,
the first ``guided_channels`` output channels guided."""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable, Union

import torch

from diffusion.sampling.options import SamplingError

if TYPE_CHECKING:
    from diffusion.models import DiT

Tensor = torch.Tensor


def guided_fn(forward_with_cfg: Callable, labels: Tensor, null_class: int) -> Callable[[Tensor, Tensor], Tensor]:
    """``(x_t, timesteps) -> guided output`` of a network called in the official DiT convention,
    ``forward_with_cfg(x twice, t twice, [labels; null class]) -> [guided; guided]``."""
    null = torch.full_like(labels, null_class)

    def guided(x, t):
        return forward_with_cfg(torch.cat([x, x]), torch.cat([t, t]), torch.cat([labels, null]))[: x.shape[0]]

    return guided


def resolve_guided_channels(value: Union[int, str, None], channels: int, option: str = "guided_channels") -> str:
    """The epsilon channels guidance applies to, as a sample set records it: ``"all"`` or a count in
    ``[1, channels]``. None: the official DiT's and SiT's first 3 (of a latent DiT's 4), or every channel of a model
    with fewer (a Fashion-MNIST DiT's one). A refusal names ``option``, the setting the caller can change."""
    if value is None:
        return str(min(3, channels))
    text = str(value)
    if text != "all" and not (text.isdigit() and 1 <= int(text) <= channels):
        count = "1" if channels == 1 else f"a number from 1 to {channels}"
        raise SamplingError(f"{option} {text}: this model has {channels} output channel{'s' * (channels > 1)} to "
                            f"guide; give {count} or 'all', or leave it out (the default guides min(3, {channels}))")
    return text


def guided_model_fn(model: DiT, labels: Tensor, cfg_scale: float, guided_channels=None) -> Callable[[Tensor, Tensor], Tensor]:
    """Classifier-free guidance through the model's ``forward_with_cfg`` (official convention: the first
    ``guided_channels`` epsilon channels are guided, by default 3 of DiT's 4 latent channels
    (:func:`resolve_guided_channels`); ``"all"`` guides every one)."""
    if model.y_embedder.embedding_table.num_embeddings <= model.num_classes:
        raise SamplingError("classifier-free guidance needs a null class, but this model was trained without label "
                            "dropout (class_dropout_prob=0): use --cfg-scale 1")
    guided = resolve_guided_channels(guided_channels, model.in_channels)
    channels = guided if guided == "all" else int(guided)
    return guided_fn(partial(model.forward_with_cfg, cfg_scale=cfg_scale, guided_channels=channels), labels,
                     model.num_classes)


def model_fn_for(model: DiT, labels: Tensor, cfg_scale: float = 1.0, guided_channels=None) -> Callable[[Tensor, Tensor], Tensor]:
    """``(x_t, timesteps) -> output`` for ``labels``; guided when ``cfg_scale != 1`` (at 1 guidance equals the
    plain forward, so its second half-batch is skipped, as in DiT)."""
    if cfg_scale == 1.0:
        return lambda x, t: model(x, t, labels)
    return guided_model_fn(model, labels, cfg_scale, guided_channels)
