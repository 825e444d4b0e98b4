"""Feature extractors for FID/IS/KID, all reached through torch-fidelity's registry, and the feature pass over an
image set (:func:`extract_features`).

* ``inception-v3-compat``: torch-fidelity's port of the TensorFlow Inception-v3 that ADM's evaluator (and so
  every published DiT FID) uses. Its weights come from a file the user gives, or from torch-fidelity's download
  cache (``<torch hub dir>/checkpoints/weights-inception-2015-12-05-6726825d.pth``). Nothing is downloaded here:
  offline is the normal case, and a missing file is an error that names the file and where to put it.
  Built as :class:`InceptionV3WithSpatial`, torch-fidelity's class plus ADM's sFID features (``mixed_6/conv``);
  every layer torch-fidelity provides is computed by torch-fidelity's own forward, unchanged.
* ``fmnist-cnn``: a small CNN classifier trained on Fashion-MNIST by ``python -m scripts.train_fmnist_classifier``
  (weights in ``~/.cache/siamesenorm/fmnist_cnn.safetensors``, never in git). Inception features of 28x28 grey
  images mean little; this gives CPU-scale experiments a meaningful Frechet distance. Registered in
  torch-fidelity under its name when this module is imported, so ``torch_fidelity.calculate_metrics(
  feature_extractor="fmnist-cnn", ...)`` works too.

    extractor = build_feature_extractor("inception-v3-compat", ["2048"], weights="inception.pth", device="cuda")
    features = extractor(images_uint8_nchw)          # tuple, one tensor per requested layer
"""
from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from torch_fidelity.feature_extractor_base import FeatureExtractorBase
from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3, FeatureExtractorInceptionV3
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor

from common.checkpoint import CheckpointError, load_weights
from common.cli import InputError
from common.distributed import cuda_available
from diffusion.evaluation.images import ImageSet
from diffusion.evaluation.metrics import MetricsError

INCEPTION = "inception-v3-compat"
FMNIST = "fmnist-cnn"
INCEPTION_WEIGHTS_FILE = URL_INCEPTION_V3.rsplit("/", 1)[-1]
FMNIST_WEIGHTS_FILE = "fmnist_cnn.safetensors"
SPATIAL_LAYER = "mixed_6/conv"  # ADM's sFID tensor, named as in the TensorFlow graph
SPATIAL_CHANNELS = 7  # ADM keeps the first 7 of its 192 channels: 7 x 17 x 17 = 2023-d features
CACHE_ENV = "SIAMESENORM_CACHE"

PathLike = Union[str, os.PathLike]


class FeatureExtractorError(InputError):
    """A feature extractor that cannot be built: unknown name, missing or wrong weights file."""


def cache_dir() -> Path:
    """The project's cache for derived weights: ``$SIAMESENORM_CACHE`` or ``~/.cache/siamesenorm``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "siamesenorm").expanduser()


def inception_cache_path() -> Path:
    """Where torch-fidelity's ``load_state_dict_from_url`` looks for (and would download) the Inception weights."""
    return Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_WEIGHTS_FILE


def fmnist_weights_path() -> Path:
    return cache_dir() / FMNIST_WEIGHTS_FILE


def read_inception_weights(path: Path) -> Dict[str, torch.Tensor]:
    """The Inception state dict, read once as plain tensors (``weights_only=True``: no code in the file runs), and
    checked to be torch-fidelity's Inception-v3 (a clear error for a wrong file)."""
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure means "not a plain state dict file"
        raise FeatureExtractorError(
            f"{path} is not a PyTorch state dict file that torch.load(weights_only=True) can read "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). Use torch-fidelity's "
            f"{INCEPTION_WEIGHTS_FILE} from {URL_INCEPTION_V3}."
        ) from err
    fc = state_dict.get("fc.weight") if isinstance(state_dict, dict) else None
    if fc is None or tuple(fc.shape) != (1008, 2048):
        raise FeatureExtractorError(
            f"{path} is not torch-fidelity's Inception-v3 (expected a state dict with fc.weight of shape "
            f"(1008, 2048)). Use {INCEPTION_WEIGHTS_FILE} from {URL_INCEPTION_V3}."
        )
    return state_dict


def weights_path(name: str, weights: Optional[PathLike] = None, option: str = "--extractor-weights") -> Optional[Path]:
    """The weights file for extractor ``name``: ``weights`` if given, else its default location; must exist (None:
    an extractor that finds its own). ``option`` is how the caller's user passes a weights file (named in the error)."""
    if weights is not None:
        path = Path(weights).expanduser()
        if not path.is_file():
            raise FeatureExtractorError(f"feature extractor weights file {str(path)!r} ({option}) does not exist")
        return path
    if name == INCEPTION:
        path = inception_cache_path()
        if not path.is_file():
            raise FeatureExtractorError(
                f"Inception-v3 weights not found at {path}. This machine does not download them. On a machine "
                f"with internet, fetch {URL_INCEPTION_V3} and either copy it to {path} (torch-fidelity's cache; "
                f"the directory follows $TORCH_HOME) or pass its path with {option}."
            )
        return path
    if name == FMNIST:
        path = fmnist_weights_path()
        if not path.is_file():
            raise FeatureExtractorError(
                f"Fashion-MNIST classifier weights not found at {path}. Train them once (a few CPU minutes) with "
                f"`python -m scripts.train_fmnist_classifier` (writes that file; ${CACHE_ENV} moves the cache), "
                f"or pass a path with {option}."
            )
        return path
    return None  # another torch-fidelity extractor: it finds (or downloads) its own weights


def resolve_weights(name: str, weights: Optional[PathLike] = None, option: str = "--extractor-weights") -> Optional[Path]:
    """:func:`weights_path`, and for Inception the file's contents checked: what a command checks before it starts
    work that ends in a FID."""
    path = weights_path(name, weights, option)
    if name == INCEPTION:
        read_inception_weights(path)
    return path


def file_sha256(path: PathLike) -> str:
    """SHA-256 of a file's bytes, read in 16 MiB blocks (the Inception weights take ~0.3 s)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def write_random_inception(path: PathLike, seed: int = 0) -> Path:
    """A weights file in the ``inception-v3-compat`` layout (torchvision's Inception-v3, 1008 classes) with seeded
    random weights, He-initialised so activations stay O(1) through eval-mode BatchNorm: the real architecture and
    cost, for benchmarks and tests on machines without the real weights (its metric values mean nothing)."""
    import math

    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.inception_v3(weights=None, aux_logits=False, num_classes=1008, init_weights=False)
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.normal_(module.weight, std=math.sqrt(2.0 / module.weight[0].numel()))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return path


# ----------------------------------------------------------------------------- Inception with ADM's sFID features

class InceptionV3WithSpatial(FeatureExtractorInceptionV3):
    """torch-fidelity's TF-compatible Inception-v3 that also provides ADM's sFID features, layer ``mixed_6/conv``.

    ADM's evaluator reads the TensorFlow graph's tensor ``mixed_6/conv:0`` (17 x 17 x 192), keeps its first 7
    channels and flattens it in NHWC order (2023 numbers per image). In the TF graph, ``mixed_6`` is the 4th of the
    four 17 x 17 Inception blocks and ``conv`` its 1x1 branch; torch-fidelity's weight conversion maps
    ``mixed_6/conv/{conv2d_params,batchnorm}`` to ``Mixed_6d.branch1x1.{conv,bn}``. The graph names a conv block's
    output (after batch norm and ReLU) after its scope, so ``mixed_6/conv:0`` is the output of
    ``Mixed_6d.branch1x1`` (a ``BasicConv2d``: conv, batch norm, ReLU); it is read here with a forward hook while
    torch-fidelity's own forward runs, then cut and flattened as ADM does.
    """

    @staticmethod
    def get_provided_features_list():
        return (*FeatureExtractorInceptionV3.get_provided_features_list(), SPATIAL_LAYER)

    @staticmethod
    def get_default_feature_layer_for_metric(metric):
        if metric == "sfid":
            return SPATIAL_LAYER
        return FeatureExtractorInceptionV3.get_default_feature_layer_for_metric(metric)

    def __init__(self, name, features_list, state_dict: Optional[Dict[str, torch.Tensor]] = None, **kwargs):
        """``state_dict``: the weights as tensors (:func:`read_inception_weights`). torch-fidelity's constructor
        takes its weights only as a file, which it unpickles with ``weights_only=False``; it gets these tensors
        re-saved in memory, so nothing from the user's file is ever unpickled that way."""
        if state_dict is not None:
            buffer = io.BytesIO()
            torch.save(state_dict, buffer)
            buffer.seek(0)
            kwargs["feature_extractor_weights_path"] = buffer
        super().__init__(name, features_list, **kwargs)

    def forward(self, x):
        requested = self.features_list
        if SPATIAL_LAYER not in requested:
            return super().forward(x)
        inner = [name for name in requested if name != SPATIAL_LAYER]
        if not any(name in ("768", "2048", "logits_unbiased", "logits") for name in inner):
            inner.append("768")  # torch-fidelity stops after the last requested layer; "768" runs past Mixed_6d
        captured = []

        def keep_spatial(module, args, out):
            captured.append(out[:, :SPATIAL_CHANNELS].permute(0, 2, 3, 1).reshape(len(out), -1).to(torch.float32))

        hook = self.Mixed_6d.branch1x1.register_forward_hook(keep_spatial)
        self.features_list = inner
        try:
            features = dict(zip(inner, super().forward(x)))
        finally:
            self.features_list = requested
            hook.remove()
        features[SPATIAL_LAYER] = captured[0]
        return tuple(features[name] for name in requested)


# ----------------------------------------------------------------------------- Fashion-MNIST classifier

FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530  # pixel statistics of the Fashion-MNIST training set (in [0, 1])
FMNIST_SIZE = 28


def fmnist_preprocess(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[B, C, H, W]`` (C = 1 or 3) -> normalized float ``[B, 1, 28, 28]``.

    Larger images are center-cropped to 28 (the pixel-space DiT pads the 28 px images to 32 with background,
    so the crop recovers them); smaller ones are resized up.
    """
    x = images.float() / 255.0
    if x.shape[1] == 3:
        x = x.mean(dim=1, keepdim=True)
    h, w = x.shape[-2:]
    if h >= FMNIST_SIZE and w >= FMNIST_SIZE:
        top, left = (h - FMNIST_SIZE) // 2, (w - FMNIST_SIZE) // 2
        x = x[..., top: top + FMNIST_SIZE, left: left + FMNIST_SIZE]
    else:
        x = F.interpolate(x, size=(FMNIST_SIZE, FMNIST_SIZE), mode="bilinear", antialias=True, align_corners=False)
    return (x - FMNIST_MEAN) / FMNIST_STD


class FashionMNISTClassifier(nn.Module):
    """Two conv blocks and two linear layers (~0.4M parameters).

    ``features`` is the 128-d penultimate layer before its ReLU (closer to Gaussian than a ReLU output).
    """

    feature_dim = 128

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Sequential(  # strided convolutions: cheap enough to train on a laptop CPU
            nn.Conv2d(1, 32, 3, stride=2, padding=1), nn.ReLU(),   # 14x14
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),  # 7x7
        )
        self.fc = nn.Linear(64 * 7 * 7, self.feature_dim)
        self.head = nn.Linear(self.feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).flatten(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.features(x)))


class FashionMNISTFeatureExtractor(FeatureExtractorBase):
    """torch-fidelity wrapper of :class:`FashionMNISTClassifier`: layers ``"128"`` (FID/KID) and ``"logits"`` (IS)."""

    def __init__(self, name, features_list, feature_extractor_weights_path=None, **kwargs):
        super().__init__(name, features_list)
        self.net = FashionMNISTClassifier()
        path = weights_path(FMNIST, feature_extractor_weights_path)
        try:
            load_weights(self.net, path)
        except CheckpointError as err:
            raise FeatureExtractorError(f"{path} is not a Fashion-MNIST classifier checkpoint: {err}") from err
        self.requires_grad_(False)
        self.eval()

    @staticmethod
    def get_provided_features_list():
        return ("128", "logits")

    @staticmethod
    def get_default_feature_layer_for_metric(metric):
        return {"isc": "logits", "fid": "128", "kid": "128", "prc": "128"}[metric]

    @staticmethod
    def can_be_compiled():
        return False

    @staticmethod
    def get_dummy_input_for_compile():
        return torch.zeros(1, 1, FMNIST_SIZE, FMNIST_SIZE, dtype=torch.uint8)

    def forward(self, x):
        if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[1] not in (1, 3):
            raise ValueError(f"{FMNIST} expects uint8 images [B, 1 or 3, H, W], got {x.dtype} {tuple(x.shape)}")
        features = self.net.features(fmnist_preprocess(x))
        out = {"128": features, "logits": self.net.head(F.relu(features))}
        return tuple(out[name] for name in self.features_list)


if FMNIST not in FEATURE_EXTRACTORS_REGISTRY:
    register_feature_extractor(FMNIST, FashionMNISTFeatureExtractor)


# ----------------------------------------------------------------------------- building

def default_layer(name: str, metric: str) -> Optional[str]:
    """The layer used for ``metric`` (``fid``, ``isc``, ``kid``, ``prc``, ``sfid``) with extractor ``name``;
    None where the extractor has none (``sfid`` needs ADM's spatial layer, which only Inception has)."""
    try:
        return registered_class(name).get_default_feature_layer_for_metric(metric)
    except KeyError:
        return None


def registered_class(name: str):
    """The class built for extractor ``name``: torch-fidelity's registry, with Inception extended by ADM's sFID
    features (:class:`InceptionV3WithSpatial`)."""
    if name not in FEATURE_EXTRACTORS_REGISTRY:
        raise FeatureExtractorError(
            f"unknown feature extractor {name!r}; registered: {', '.join(sorted(FEATURE_EXTRACTORS_REGISTRY))}"
        )
    return InceptionV3WithSpatial if name == INCEPTION else FEATURE_EXTRACTORS_REGISTRY[name]


def build_feature_extractor(name: str, layers: Sequence[str], weights: Optional[PathLike] = None,
                            device: Union[str, torch.device] = "cpu") -> FeatureExtractorBase:
    """A torch-fidelity feature extractor in eval mode on ``device``; weights found by :func:`weights_path` (Inception's
    read once, as tensors: :func:`read_inception_weights`).

    Call it with uint8 ``[B, 3, H, W]`` images; it returns one tensor per requested layer, in order. It carries
    ``weights_path`` and ``weights_sha256`` (None for extractors that find their own weights), which results record.
    """
    cls = registered_class(name)
    provided = cls.get_provided_features_list()
    unknown = [layer for layer in layers if layer not in provided]
    if unknown:
        raise FeatureExtractorError(f"{name} has no layer(s) {unknown}; it provides {list(provided)}")
    path = weights_path(name, weights)
    if name == INCEPTION:  # the file is read once, as tensors
        extractor = cls(name, list(dict.fromkeys(layers)), state_dict=read_inception_weights(path), verbose=False)
    else:
        extractor = cls(name, list(dict.fromkeys(layers)), verbose=False,
                        feature_extractor_weights_path=None if path is None else str(path))
    extractor.requires_grad_(False).eval()
    extractor.weights_path = None if path is None else str(path)
    extractor.weights_sha256 = None if path is None else file_sha256(path)
    return extractor.to(device)


# ----------------------------------------------------------------------------- the feature pass

POOL, SPATIAL, LOGITS = "pool", "spatial", "logits"  # what each metric reads: Evaluator.features() keys


def extractor_layers(feature_extractor: str, feature_layer: Optional[str], roles: Sequence[str]) -> Dict[str, str]:
    """``{role: layer}`` for the roles the extractor provides (``feature_layer`` overrides the pool layer)."""
    provided = registered_class(feature_extractor).get_provided_features_list()
    if feature_layer is not None and feature_layer not in provided:
        raise MetricsError(f"{feature_extractor} has no layer {feature_layer!r}; it provides {list(provided)}")
    defaults = {POOL: feature_layer or default_layer(feature_extractor, "fid"),
                SPATIAL: default_layer(feature_extractor, "sfid"), LOGITS: default_layer(feature_extractor, "isc")}
    return {role: defaults[role] for role in roles if defaults[role] in provided}


def default_device() -> str:
    return "cuda" if cuda_available() else "cpu"


@torch.no_grad()
def feature_batches(images: ImageSet, extractor, batch_size: int = 50, num_workers: int = 0, start: int = 0,
                    stop: Optional[int] = None) -> Iterator[Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]]:
    """``(positions, uint8 images, {layer: float32 features on the CPU})`` per batch of a torch-fidelity extractor.

    Grey images are repeated to RGB (torch-fidelity's extractors take RGB; ``fmnist-cnn`` averages them back).
    """
    device = next(extractor.parameters()).device
    for positions, batch in images.indexed_batches(batch_size, num_workers, start, stop):
        rgb = batch.expand(-1, 3, -1, -1) if batch.shape[1] == 1 else batch
        outputs = extractor(rgb.to(device))
        yield positions, batch, {name: f.float().cpu() for name, f in zip(extractor.features_list, outputs)}


def extract_features(images: ImageSet, extractor, batch_size: int = 50, num_workers: int = 0,
                     progress: bool = False, start: int = 0, stop: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """The features of the images at positions ``start .. stop - 1`` (all by default), ``{layer: float32 [N, D]}``
    on the CPU, one pass of :func:`feature_batches`."""
    stop = len(images) if stop is None else stop
    out: Dict[str, List[torch.Tensor]] = {name: [] for name in extractor.features_list}
    seen, skipped_before = 0, len(images.skipped)
    bar = tqdm(total=stop - start, unit="img", desc=f"features {images.source}", disable=not progress, leave=False)
    for _, batch, features in feature_batches(images, extractor, batch_size, num_workers, start, stop):
        for name, f in features.items():
            out[name].append(f)
        seen += len(batch)
        bar.update(len(batch))
    bar.close()
    if seen + len(images.skipped) - skipped_before != stop - start:
        raise MetricsError(f"{images.source}: read {seen} images, expected {stop - start}")
    if seen == 0 and stop > start:
        raise MetricsError(f"{images.source}: no readable images")
    return {name: torch.cat(chunks) for name, chunks in out.items()}
