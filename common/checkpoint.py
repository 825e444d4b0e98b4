"""Model weights in and out: our checkpoints and the public layouts, converted by name, strictly.

``load_weights(model, source)`` accepts a path (``.safetensors``; ``.pt``/``.pth``/``.bin`` read with
``torch.load(weights_only=True)``) or an in-memory state dict. Training checkpoints that wrap the
weights (``{"model": ..., "ema": ...}``) are unwrapped; DDP ``module.`` and ``torch.compile``
``_orig_mod.`` prefixes are stripped. A model class that knows foreign layouts exposes
``convert_state_dict(state_dict, model)``, which is applied before a strict load.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from common.cli import InputError
from common.durable import atomic_write

StateDict = Mapping[str, torch.Tensor]
Source = Union[str, os.PathLike, StateDict]

# Keys under which training scripts commonly nest the weights, in order of preference.
WRAPPER_KEYS = ("model", "state_dict", "module", "ema", "model_ema")
STRIP_PREFIXES = ("module.", "_orig_mod.")


class CheckpointError(InputError):
    """A checkpoint that cannot be read or does not fit the model."""


class WeightsMismatchError(CheckpointError):
    """Weights whose names or shapes do not fit the model: ``missing`` and ``unexpected`` names, ``shapes`` (``name:
    file (...) vs model (...)``), so that a caller can say it in its own terms (:meth:`summary`)."""

    def __init__(self, message: str, missing: Sequence[str] = (), unexpected: Sequence[str] = (),
                 shapes: Sequence[str] = ()):
        super().__init__(message)
        self.missing, self.unexpected, self.shapes = list(missing), list(unexpected), list(shapes)

    def summary(self, limit: int = 3) -> str:
        """The mismatch in a few words: counts and the first ``limit`` names of each kind."""
        kinds = [(self.missing, "missing key{}"), (self.unexpected, "unexpected key{}"),
                 (self.shapes, "key{} of another shape")]
        return "; ".join(f"{len(keys)} {what.format('s' * (len(keys) != 1))} ({_format_keys(keys, limit)})"
                         for keys, what in kinds if keys)


def _format_keys(keys: Sequence[str], limit: int = 20) -> str:
    keys = list(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def read_file(path: Union[str, os.PathLike]) -> dict:
    """Read a weights file without executing code: safetensors, or a torch pickle of plain containers."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist or is not a file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights_only" not in str(err).lower() and "unsupported global" not in str(err).lower():
            raise CheckpointError(f"{path} is damaged or not a weights file ({str(err).splitlines()[0]})") from None
        raise CheckpointError(
            f"{path} is not a plain state dict: torch.load(weights_only=True) refused it ({str(err).splitlines()[0]}). "
            "Re-save it as a dict of tensors (torch.save(model.state_dict(), ...)) or as .safetensors."
        ) from err
    except Exception as err:  # SafetensorError, EOFError, RuntimeError("PytorchStreamReader failed ..."), ...
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{path} is damaged or not a weights file ({type(err).__name__}: {detail}); "
                              "restore it or write it again") from None


def unwrap_state_dict(obj, key: Optional[str] = None) -> dict:
    """Find the flat ``name -> tensor`` mapping inside a (possibly wrapped) checkpoint object.

    ``key`` picks a wrapper entry explicitly (e.g. ``"model"`` instead of the default ``"ema"``).
    """
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"expected a state dict (a mapping of names to tensors), got {type(obj).__name__}")
    if key is not None:
        if key not in obj:
            raise CheckpointError(f"checkpoint has no entry {key!r}; its top-level keys are: {_format_keys(sorted(obj))}")
        if not isinstance(obj[key], Mapping):
            raise CheckpointError(f"checkpoint entry {key!r} holds no weights (it is {obj[key]!r}); "
                                  + ("the run was trained without an EMA (train.ema_decay): evaluate weights=model"
                                     if key == "ema" else "pick another entry"))
        obj = obj[key]
    elif not all(isinstance(v, torch.Tensor) for v in obj.values()):
        for k in WRAPPER_KEYS:
            if isinstance(obj.get(k), Mapping):
                obj = obj[k]
                break
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(
            f"not a plain state dict: entries {_format_keys(bad)} are not tensors. "
            f"Pass key=... to pick the weights entry (top-level keys: {_format_keys(sorted(obj))})."
        )
    out = {}
    for k, v in obj.items():
        for prefix in STRIP_PREFIXES:
            while k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


def weight_shapes(path: Union[str, os.PathLike]) -> dict:
    """``{name: shape}`` of a weights file's tensors, unwrapped as :func:`load_weights` unwraps them, without reading
    the tensors: a ``.safetensors`` header, or a torch file mapped into memory (read whole where it cannot be)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            raw = {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
    else:
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - an old (not zip) torch file cannot be mapped; read_file names damage
            raw = read_file(path)
    return {k: tuple(v.shape) for k, v in unwrap_state_dict(raw).items()}


def convert_state_dict(state_dict: StateDict, prefix_map: Mapping[str, str]) -> dict:
    """Rename keys by their leading prefix (first matching prefix wins)."""
    out = {}
    for k, v in state_dict.items():
        for old, new in prefix_map.items():
            if k.startswith(old):
                k = new + k[len(old):]
                break
        out[k] = v
    return out


def bare_model(model: nn.Module) -> nn.Module:
    """The module under DDP/accelerate (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


def load_weights(model: nn.Module, source: Source, strict: bool = True, key: Optional[str] = None):
    """Load weights into ``model`` from a path or a state dict, converting public layouts by name.

    Raises :class:`CheckpointError` naming every missing and unexpected key when ``strict`` and the
    names do not match, and on shape mismatches. Returns torch's ``(missing, unexpected)`` result.
    """
    target = bare_model(model)
    raw = read_file(source) if isinstance(source, (str, os.PathLike)) else source
    state_dict = unwrap_state_dict(raw, key=key)
    convert = getattr(target, "convert_state_dict", None)
    if callable(convert):
        state_dict = convert(state_dict, target)
    own = target.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        name = type(target).__name__
        raise WeightsMismatchError(
            f"checkpoint does not match {name}: {len(missing)} missing keys [{_format_keys(missing)}]; "
            f"{len(unexpected)} unexpected keys [{_format_keys(unexpected)}]. Check the model name/topology "
            "and sizes, or pass strict=False to load the overlap.", missing, unexpected)
    shape_errors = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in state_dict.items()
        if k in own and v.shape != own[k].shape
    ]
    if shape_errors:
        raise WeightsMismatchError("checkpoint shapes do not match the model: " + "; ".join(shape_errors[:20]),
                                   shapes=shape_errors)
    return target.load_state_dict(state_dict, strict=strict)


def save_weights(source: Union[nn.Module, StateDict], path: Union[str, os.PathLike], metadata: Optional[dict] = None):
    """Save weights as ``.safetensors`` (or a torch pickle for other suffixes), atomically and durably."""
    state_dict = bare_model(source).state_dict() if isinstance(source, nn.Module) else source
    state_dict = {k: v.detach().contiguous().cpu().clone() for k, v in state_dict.items()}
    path = Path(path)
    with atomic_write(path) as tmp:
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state_dict, str(tmp), metadata={k: str(v) for k, v in (metadata or {}).items()})
        else:
            with open(tmp, "wb") as f:
                torch.save(state_dict, f)
    return path


def upload_to_hub(push: Callable[[], object], repo_id: str, folder: Union[str, os.PathLike]) -> None:
    """``push()``, which uploads the written ``folder`` to the Hugging Face repository ``repo_id``. Offline, without a
    token or without rights it ends in one line saying why; the folder stays written, to upload later."""
    try:
        push()
    except Exception as err:  # noqa: BLE001 - offline, no token, no rights: the folder is written either way
        detail = str(err).splitlines()[0] if str(err) else "no message"
        raise InputError(f"--push-to-hub {repo_id}: {type(err).__name__}: {detail} (the folder {folder} is written; "
                         f"upload it later with `hf upload {repo_id} {folder}`)") from None


def weights_fingerprint(state_dict: StateDict) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of the weights: equal iff the model (a DiT, a VAE) is the same,
    whatever file (or path) it came from."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
