"""The checkpoint formats a DiT is read from, each with what it records of the model (:class:`~diffusion.spec.DiTSpec`):

* a ``.safetensors`` file of ``diffusion.train`` (``model.safetensors``, ``ema.safetensors``): the spec in its metadata;
* a training checkpoint ``step_*.pt``: the spec as the run's weights record it (older checkpoints: the run's config,
  the latents' channels and size read off the weights), the EMA weights by default;
* a ``save_pretrained`` folder (:class:`diffusion.hub.DiTModel`): ``config.json`` and :data:`HUB_WEIGHTS`;
* a plain state dict (the official ``DiT-XL-2-256x256.pt``): nothing, so the published DiT's values.

:func:`load_dit` rebuilds the model from any of them. The public SiameseNorm DiT key layout is converted by the model
itself (``DiT.convert_state_dict``), as a weights file of any of these formats may hold it.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from common.checkpoint import CheckpointError, load_weights, read_file, unwrap_state_dict
from diffusion.latents import load_vae_config, vae_downsampling
from diffusion.models import DiT
from diffusion.spec import DiTSpec

HUB_WEIGHTS = "diffusion_pytorch_model.safetensors"  # the weights file of a save_pretrained folder (diffusion.hub)
HUB_CLASS = "DiTModel"  # the class name diffusers records in its config.json: diffusion.hub.DiTModel


def read_checkpoint(path, weights: Optional[str] = None) -> Tuple[Any, Dict[str, Any], Optional[str]]:
    """``(state dict source, spec fields the file records, weights entry used)`` of any DiT checkpoint: a
    safetensors file of diffusion.train (metadata), a training checkpoint ``step_*.pt`` (its config; the EMA weights
    unless ``weights`` names another entry), a ``save_pretrained`` folder (``config.json``) or a plain state dict."""
    path = Path(path)
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{path} is a folder without config.json: not a saved DiT (DiTModel.save_pretrained)")
        config = json.loads(config_file.read_text())
        if config.get("_class_name") != HUB_CLASS:
            raise CheckpointError(f"{config_file} describes a {config.get('_class_name')}, not a {HUB_CLASS} (python -m "
                                  "diffusion.export --format hub writes one)")
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        config["kwargs"] = config.pop("model_kwargs", None) or {}  # diffusers' configs cannot hold a key "kwargs"
        return read_file(path / HUB_WEIGHTS), {k: v for k, v in config.items() if v is not None}, None
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        source = read_file(path)  # a missing, truncated or damaged file is a CheckpointError naming it
        with safe_open(str(path), "pt") as f:
            return source, DiTSpec.from_metadata(f.metadata() or {}), None
    raw = read_file(path)
    if isinstance(raw.get("weights_metadata"), dict):
        found = DiTSpec.from_metadata(raw["weights_metadata"])
    else:
        found = DiTSpec.from_train_config(raw["config"]) if isinstance(raw.get("config"), dict) else {}
    if weights is None and isinstance(raw.get("ema"), dict):
        weights = "ema"  # sample the EMA weights by default, as DiT does
    return raw, found, weights


def learns_sigma(state_dict: Dict[str, Any], spec: DiTSpec) -> bool:
    """Whether the weights' final layer has the learned variance's outputs (``2 p p C``, the published DiT's) or
    only epsilon's or the velocity's (``p p C``); the spec's own value where the layer is missing or fits neither."""
    weight = state_dict.get("final_layer.linear.weight")
    outputs = spec.dit_kwargs()["patch_size"] ** 2 * spec.in_channels
    if weight is None or weight.shape[0] not in (outputs, 2 * outputs):
        return spec.learn_sigma
    return weight.shape[0] == 2 * outputs


def latent_geometry(state_dict: Dict[str, Any]) -> Dict[str, int]:
    """``in_channels`` and ``input_size`` of the samples a DiT's weights denoise, read off its patch embedding
    (``C`` input channels, ``p x p`` patches) and its position table (``(input_size / p)^2`` tokens); empty where
    the weights lack them."""
    proj, pos = state_dict.get("x_embedder.proj.weight"), state_dict.get("pos_embed")
    if proj is None or pos is None:
        return {}
    grid = math.isqrt(pos.shape[-2])
    return {"in_channels": int(proj.shape[1]), "input_size": grid * int(proj.shape[-1])}


def load_dit(checkpoint, overrides: Optional[Dict[str, Any]] = None, weights: Optional[str] = None
             ) -> Tuple[DiT, DiTSpec, str]:
    """``(model in eval mode, its spec, the weights entry used)`` from any checkpoint (:func:`read_checkpoint`).

    ``overrides`` (None values ignored) take precedence over the file; ``image_size`` (pixels) sets the
    ``input_size`` of a latent model through its VAE's downsampling (:func:`diffusion.latents.vae_downsampling`).
    Where neither says the latents' channels and size (a plain state dict, an older ``step_*.pt``), the weights do
    (:func:`latent_geometry`). The model is built on the meta device and given empty storage: the strict load fills
    every parameter and persistent buffer, so DiT's initialisation (random draws over all the weights) would be
    overwritten, and is skipped; the non-persistent buffers (RoPE's tables) are computed again."""
    source, found, key = read_checkpoint(checkpoint, weights)
    overrides = dict(overrides or {})
    image_size = overrides.pop("image_size", None)
    try:
        state_dict = unwrap_state_dict(source, key)
        found = {**latent_geometry(state_dict), **found}
        spec = DiTSpec.resolve(found, overrides)
        if image_size is not None:
            pixel = spec.autoencoder == "none"
            factor = 1 if pixel else vae_downsampling(load_vae_config(spec.autoencoder, option="--vae"))
            spec = dataclasses.replace(spec, input_size=image_size // factor)
        if "learn_sigma" not in found:  # a plain state dict: its output layer says (SiT's sample.py builds both)
            spec = dataclasses.replace(spec, learn_sigma=learns_sigma(state_dict, spec))
        with torch.device("meta"):
            model = spec.build()
        model = model.to_empty(device="cpu")
        for module in model.modules():  # the buffers no state dict holds (RoPE's tables) are computed, not loaded
            if hasattr(module, "init_non_persistent_buffers"):
                module.init_non_persistent_buffers()
        load_weights(model, state_dict)
    except CheckpointError as err:
        raise CheckpointError(f"{checkpoint}: {err}") from None
    return model.eval().requires_grad_(False), spec, key or "weights"
