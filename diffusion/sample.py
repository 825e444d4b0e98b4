"""Sample a class-conditional DiT: a PNG grid to look at, or N images for FID, on one or many processes.

    # a grid of chosen classes (EMA weights of a run of diffusion.train)
    python -m diffusion.sample --checkpoint runs/dit_b2_siamese/ema.safetensors --grid grid.png --labels 207,360,387,974

    # FID-50K samples: 250 respaced DDPM steps, exactly 50,000 images, 50 per class, on 8 GPUs
    accelerate launch --num_processes 8 -m diffusion.sample --checkpoint runs/dit_b2_siamese/ema.safetensors \\
        --num-samples 50000 --out-dir samples/dit_b2_siamese
    python -m diffusion.fid --samples samples/dit_b2_siamese/samples.npz --reference VIRTUAL_imagenet256_labeled.npz

    # the official DiT-XL/2 weights (no metadata inside: say which model), cfg 1.5 on the first 3 latent channels
    python -m diffusion.sample --checkpoint DiT-XL-2-256x256.pt --model DiT-XL/2 --image-size 256 \\
        --cfg-scale 1.5 --num-samples 50000 --out-dir samples/dit_xl2_cfg1.5

Checkpoints: ``.safetensors`` written by diffusion.train (the model is rebuilt from the metadata inside),
training checkpoints ``step_*.pt`` (EMA weights unless ``--weights model``), or plain state dicts such as the
official DiT ones (then ``--model`` and ``--image-size`` are needed). The VAE (``--vae``) defaults to the one
the model was trained with; ``--vae none`` for pixel-space models.

Timesteps follow ADM's respacing conventions: ``--sampler ddpm`` keeps ``--steps`` evenly spaced steps (ADM's
"250": 0, 4, 8, ..., 999), ``--sampler ddim`` strides from 0 (ADM's and DiT's "ddim50": 0, 20, ..., 980; step counts
that no integer stride gives are refused). ``--spacing even|ddim`` picks the other rule explicitly. The exact
steps are recorded in the sampling protocol.

Sample ``i`` (0 <= i < N) has class ``i % num_classes`` and its own noise stream, seeded by ``(--seed, i)``:
the set is the same for any number of processes. Work is split in chunks of ``--batch-size`` samples, written
to ``OUT/chunks/`` as they finish; a rerun with the same options skips finished chunks (resume after a crash
or a time limit). ``OUT/settings.json`` records the options and a SHA-256 fingerprint of the sampled weights'
content: a rerun whose checkpoint holds other weights (e.g. a training run refreshed ``ema.safetensors`` in
between) is refused, so a sample set never mixes two models. Every file is written atomically and fsynced.
Outputs: ``OUT/samples.npz`` (ADM format: ``arr_0`` uint8 [N, H, W, C], ``arr_1`` labels, and the sampling
protocol as JSON, which diffusion.fid records), ``OUT/images/*.png`` with ``--format png|both``.
Chunk files must be on a file system all processes share.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch

from common.checkpoint import CheckpointError, load_weights, read_file, weights_fingerprint
from common.cli import InputError, one_line_errors
from common.distributed import use_fast_cuda_kernels
from common.durable import atomic_savez, atomic_write, atomic_write_text
from common.metrics import SAMPLING_PROTOCOL_FILE, SAMPLING_PROTOCOL_KEY, MetricsError, images_to_uint8
from diffusion.gaussian_diffusion import SPACINGS, GaussianDiffusion
from diffusion.latents import DEFAULT_VAE, load_vae
from diffusion.models import DIT_TOPOLOGIES, DiT, DiT_models

Tensor = torch.Tensor
SAMPLERS = ("ddpm", "ddim")
DIT_SAMPLE_LABELS = (207, 360, 387, 974, 88, 979, 417, 279)  # the official DiT sample.py classes
SETTINGS_FILE = "settings.json"


class SamplingError(InputError):
    """Options or checkpoints that cannot give the requested samples."""


# ----------------------------------------------------------------------------------------- model

@dataclass
class ModelSpec:
    """Everything needed to rebuild a DiT around its weights."""

    name: str = "DiT-XL/2"
    topology: str = "pre"
    learn_sigma: bool = True
    class_dropout_prob: float = 0.1
    in_channels: int = 4
    input_size: int = 32
    num_classes: int = 1000
    kwargs: Dict = field(default_factory=dict)
    autoencoder: str = DEFAULT_VAE  # "none": pixel space
    vae_sha256: Optional[str] = None  # the VAE that encoded the training latents (weights fingerprint), if recorded
    vae_scaling_factor: Optional[float] = None


def _spec_from_safetensors_metadata(meta: Dict[str, str]) -> dict:
    """The metadata diffusion.train writes into ema.safetensors / model.safetensors (all values are strings)."""
    if "model" not in meta:
        return {}
    as_bool = lambda s: s.lower() == "true"  # noqa: E731
    convert = {"model": ("name", str), "topology": ("topology", str), "learn_sigma": ("learn_sigma", as_bool),
               "class_dropout_prob": ("class_dropout_prob", float), "in_channels": ("in_channels", int),
               "input_size": ("input_size", int), "num_classes": ("num_classes", int),
               "model_kwargs": ("kwargs", json.loads), "autoencoder": ("autoencoder", str),
               "vae_sha256": ("vae_sha256", str), "vae_scaling_factor": ("vae_scaling_factor", float)}
    return {name: fn(meta[key]) for key, (name, fn) in convert.items() if key in meta}


def _spec_from_training_config(config: dict) -> dict:
    """A training checkpoint's ``config`` entry (diffusion.train's TrainConfig as a dict)."""
    model, data = config.get("model", {}), config.get("data", {})
    pixel = data.get("dataset") == "fashion_mnist"
    image_size = data.get("image_size", 256)
    return {"name": model.get("name"), "topology": model.get("topology"), "learn_sigma": model.get("learn_sigma"),
            "class_dropout_prob": model.get("class_dropout_prob"), "kwargs": model.get("kwargs", {}),
            "in_channels": 1 if pixel else 4, "input_size": image_size if pixel else image_size // 8,
            "num_classes": data.get("num_classes"), "autoencoder": data.get("autoencoder")}


def read_checkpoint(path, weights: Optional[str] = None):
    """``(state dict source, spec fields found in the file, weights entry used)`` for a sampling checkpoint."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        weights = read_file(path)  # a missing, truncated or damaged file is a CheckpointError naming it
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return weights, _spec_from_safetensors_metadata(meta), None
    raw = read_file(path)
    found = {}
    if isinstance(raw.get("config"), dict):
        found = {k: v for k, v in _spec_from_training_config(raw["config"]).items() if v is not None}
    if weights is None and isinstance(raw.get("ema"), dict):
        weights = "ema"  # sample the EMA weights by default, as DiT does
    return raw, found, weights


def resolve_spec(found: dict, overrides: dict) -> ModelSpec:
    """Command-line values over the checkpoint's own description over the official DiT defaults."""
    values = {**found, **{k: v for k, v in overrides.items() if v is not None}}
    if "name" not in values:
        raise SamplingError(
            "this checkpoint does not say which model it holds (a plain state dict such as the official "
            f"DiT-XL-2-256x256.pt): pass --model (one of {', '.join(DiT_models)}) and --image-size"
        )
    if values["name"] not in DiT_models:
        raise SamplingError(f"--model {values['name']!r} is not a DiT; choose one of {', '.join(DiT_models)}")
    return ModelSpec(**values)


def build_model(spec: ModelSpec) -> DiT:
    return DiT_models[spec.name](
        input_size=spec.input_size, in_channels=spec.in_channels, num_classes=spec.num_classes,
        learn_sigma=spec.learn_sigma, class_dropout_prob=spec.class_dropout_prob, topology=spec.topology, **spec.kwargs,
    )


def load_model(checkpoint, overrides: Optional[dict] = None, weights: Optional[str] = None):
    """``(model in eval mode, spec, weights entry)`` from a checkpoint (see the module docstring)."""
    source, found, key = read_checkpoint(checkpoint, weights)
    image_size = (overrides or {}).pop("image_size", None)
    if image_size is not None:  # latent models: 8x downsampling VAE
        pixel = (overrides.get("autoencoder") or found.get("autoencoder")) == "none"
        overrides["input_size"] = image_size if pixel else image_size // 8
    spec = resolve_spec(found, overrides or {})
    model = build_model(spec)
    try:
        load_weights(model, source, key=key)
    except CheckpointError as err:
        raise SamplingError(f"{checkpoint}: {err}") from err
    return model.eval().requires_grad_(False), spec, key or "weights"


# ------------------------------------------------------------------------------ noise and labels

def sample_generator(seed: int, index: int) -> torch.Generator:
    """The noise stream of global sample ``index``: independent of batching and of the number of processes."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([int(seed), int(index)]).generate_state(1)[0]))


def draw_noise(generators: Sequence[torch.Generator], shape: Sequence[int]) -> Tensor:
    """One standard normal draw of ``shape`` from each sample's stream (on the CPU), stacked into a batch."""
    return torch.stack([torch.randn(tuple(shape), generator=g) for g in generators])


def balanced_labels(indices: Tensor, num_classes: int) -> Tensor:
    """Sample ``i`` gets class ``i % num_classes``: exactly N / num_classes per class when divisible."""
    return indices % num_classes


# ------------------------------------------------------------------------------------- sampling

def guided_model_fn(model: DiT, labels: Tensor, cfg_scale: float, guided_channels="3") -> Callable[[Tensor, Tensor], Tensor]:
    """Classifier-free guidance through the model's ``forward_with_cfg`` (official convention: the first
    ``guided_channels`` epsilon channels are guided, 3 of DiT's 4 latent channels; ``"all"`` guides every one)."""
    if model.y_embedder.embedding_table.num_embeddings <= model.num_classes:
        raise SamplingError("classifier-free guidance needs a null class, but this model was trained without label "
                            "dropout (class_dropout_prob=0): use --cfg-scale 1")
    channels = guided_channels if guided_channels == "all" else int(guided_channels)
    null = torch.full_like(labels, model.num_classes)

    def guided(x, t):
        out = model.forward_with_cfg(torch.cat([x, x]), torch.cat([t, t]), torch.cat([labels, null]), cfg_scale, channels)
        return out[: x.shape[0]]

    return guided


def model_fn_for(model: DiT, labels: Tensor, cfg_scale: float = 1.0, guided_channels="3") -> Callable[[Tensor, Tensor], Tensor]:
    """``(x_t, timesteps) -> output`` for ``labels``; guided when ``cfg_scale != 1`` (at 1 guidance equals the
    plain forward, so its second half-batch is skipped, as in DiT)."""
    if cfg_scale == 1.0:
        return lambda x, t: model(x, t, labels)
    return guided_model_fn(model, labels, cfg_scale, guided_channels)


def ddim_step(diffusion: GaussianDiffusion, model_output: Tensor, x_t: Tensor, t: Tensor, noise: Tensor,
              eta: float = 0.0) -> Tensor:
    """One DDIM step (Song et al.; ADM's ``ddim_sample``) on the respaced schedule of ``diffusion``.

    Written here because diffusers' DDIMScheduler steps to ``t - T // n``, not to the previous respaced step.
    """
    eps, _ = diffusion.split_output(model_output, x_t)
    x0 = diffusion.predict_xstart_from_eps(x_t, t, eps)
    shape = (-1, *([1] * (x_t.ndim - 1)))
    abar = diffusion.alphas_cumprod.to(x_t.device)[t].to(x_t.dtype).reshape(shape)
    abar_prev = diffusion.alphas_cumprod_prev.to(x_t.device)[t].to(x_t.dtype).reshape(shape)
    sigma = eta * torch.sqrt((1 - abar_prev) / (1 - abar)) * torch.sqrt(1 - abar / abar_prev)
    mean = x0 * torch.sqrt(abar_prev) + torch.sqrt(1 - abar_prev - sigma ** 2) * eps
    nonzero = (t != 0).to(x_t.dtype).reshape(shape)
    return mean + nonzero * sigma * noise


@torch.no_grad()
def reverse_chain(model_fn, diffusion: GaussianDiffusion, generators: Sequence[torch.Generator], shape: Sequence[int],
                  sampler: str = "ddpm", eta: float = 0.0, device="cpu") -> Iterator[Tensor]:
    """The reverse chain for one batch, state by state: yields x_T, then x after each respaced step (x_0 last).
    Sample ``b`` draws its x_T and step noise from ``generators[b]``.

    ``ddpm``: ancestral steps with the learned (or fixed) variance, :meth:`GaussianDiffusion.p_sample`;
    ``ddim``: :func:`ddim_step` with ``eta``.
    """
    if sampler not in SAMPLERS:
        raise SamplingError(f"sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    x = draw_noise(generators, shape).to(device)
    yield x
    for i in range(diffusion.num_timesteps - 1, -1, -1):
        t = torch.full((x.shape[0],), i, device=device, dtype=torch.long)
        out = model_fn(x, diffusion.model_timesteps(t))
        noise = draw_noise(generators, shape).to(device)
        if sampler == "ddpm":
            x = diffusion.p_sample(out, x, t, noise)["sample"]
        else:
            x = ddim_step(diffusion, out, x, t, noise, eta)
        yield x


def sample_loop(model_fn, diffusion: GaussianDiffusion, generators: Sequence[torch.Generator], shape: Sequence[int],
                sampler: str = "ddpm", eta: float = 0.0, device="cpu") -> Tensor:
    """x_0 of :func:`reverse_chain`."""
    for x in reverse_chain(model_fn, diffusion, generators, shape, sampler, eta, device):
        pass
    return x


class VAEMismatchError(SamplingError):
    """The VAE given is not the one the latents (and so the model) were made with."""


class Decoder:
    """Model outputs -> uint8 images ``[B, C, H, W]``: through the VAE (``x / scaling_factor``) or as pixels.

    ``expect`` (``vae``, ``vae_sha256``, ``vae_scaling_factor``, as the latents' metadata and the model's weights
    record them) is checked against the loaded VAE: decoding with another VAE gives wrong images without an error.
    ``nonfinite="raise"`` refuses NaN/inf samples; ``"black"`` draws them black and counts them in
    :attr:`nonfinite_images` (training grids and FIDs, which must never stop a run).
    """

    def __init__(self, autoencoder: str, device, option: str = "--vae", expect: Optional[dict] = None,
                 nonfinite: str = "raise", made_with: str = "the model was trained on"):
        self.vae, self.scaling_factor, self.fingerprint = None, 1.0, None
        self.nonfinite, self.nonfinite_images = nonfinite, 0
        if autoencoder != "none":
            vae = load_vae(autoencoder, option=option)
            self.fingerprint = weights_fingerprint(vae.state_dict())
            self.scaling_factor = float(vae.config.scaling_factor)
            self._check(autoencoder, option, expect or {}, made_with)
            self.vae = vae.to(device).eval().requires_grad_(False)

    def _check(self, autoencoder: str, option: str, expect: dict, made_with: str) -> None:
        want_scale, want_sha = expect.get("vae_scaling_factor"), expect.get("vae_sha256")
        scale_differs = want_scale is not None and not math.isclose(float(want_scale), self.scaling_factor, rel_tol=1e-6)
        if not (scale_differs or (want_sha and want_sha != self.fingerprint)):
            return
        recorded = ", ".join(f"{k} {v}" for k, v in (("vae", expect.get("vae")), ("scaling factor", want_scale),
                                                        ("weights sha256", (want_sha or "")[:16])) if v)
        given = f"{option}={autoencoder}" if option.startswith(("data.", "train.")) else f"{option} {autoencoder}"
        raise VAEMismatchError(
            f"{given} is not the VAE {made_with} (recorded: {recorded}; this one: scaling factor "
            f"{self.scaling_factor:g}, weights sha256 {self.fingerprint[:16]}): its decoded images would be wrong. "
            f"Point {option} at the VAE that encoded the latents")

    @torch.no_grad()
    def __call__(self, x: Tensor) -> Tensor:
        if self.vae is not None:
            x = self.vae.decode(x / self.scaling_factor).sample
        x = x.float()
        if self.nonfinite == "black":
            finite = torch.isfinite(x)
            self.nonfinite_images += int((~finite).flatten(1).any(dim=1).sum())
            x = torch.where(finite, x, -1.0)
        return images_to_uint8(x.clamp(-1.0, 1.0).cpu())  # with nonfinite="raise", NaN samples raise here


@dataclass
class Sampler:
    """A model, its diffusion and decoder, and the sampling options: ``sampler(indices, labels) -> uint8``."""

    model: DiT
    spec: ModelSpec
    decoder: Decoder
    diffusion: GaussianDiffusion
    sampler: str = "ddpm"
    eta: float = 0.0
    cfg_scale: float = 1.0
    guided_channels: str = "3"
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self):
        self.diffusion.to(self.device)  # the schedule next to the model: no host-to-device copy per step

    def __call__(self, indices: Tensor, labels: Tensor) -> Tensor:
        generators = [sample_generator(self.seed, int(i)) for i in indices]
        model_fn = model_fn_for(self.model, labels.to(self.device), self.cfg_scale, self.guided_channels)
        shape = (self.spec.in_channels, self.spec.input_size, self.spec.input_size)
        x = sample_loop(model_fn, self.diffusion, generators, shape, self.sampler, self.eta, self.device)
        return self.decoder(x)


# ------------------------------------------------------------------------------ chunks and outputs

def chunk_path(out_dir: Path, k: int) -> Path:
    return out_dir / "chunks" / f"chunk_{k:06d}.npz"


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def write_adm_npz(path: Path, chunk_files: Sequence[Path], count: int, image_shape: Sequence[int], protocol: dict) -> None:
    """``arr_0`` (uint8 [N, H, W, C]), ``arr_1`` (labels) and the protocol, streamed chunk by chunk, so the
    file can be larger than memory (np.savez needs the whole array)."""
    labels = []
    with atomic_write(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        with zf.open("arr_0.npy", "w", force_zip64=True) as f:
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
                      "shape": (count, *image_shape)}
            np.lib.format.write_array_header_1_0(f, header)
            for chunk in chunk_files:
                with np.load(chunk) as data:
                    f.write(np.ascontiguousarray(data["images"]).tobytes())
                    labels.append(data["labels"])
        zf.writestr("arr_1.npy", _npy_bytes(np.concatenate(labels)))
        zf.writestr(f"{SAMPLING_PROTOCOL_KEY}.npy", _npy_bytes(np.array(json.dumps(protocol))))


def write_pngs(folder: Path, chunk_files: Sequence[Path], protocol: dict) -> None:
    """One PNG per sample, each written atomically; all are rewritten from the chunks (the source of truth), so
    files left by an interrupted earlier run are never trusted."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.tmp"):  # a kill while writing a PNG leaves only its temporary file
        stale.unlink()
    for chunk in chunk_files:
        with np.load(chunk) as data:
            for index, image in zip(data["indices"], data["images"]):
                with atomic_write(folder / f"{int(index):06d}.png") as tmp:
                    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(tmp, format="PNG")
    atomic_write_text(folder / SAMPLING_PROTOCOL_FILE, json.dumps(protocol, indent=2))


def sampling_settings(args, spec: ModelSpec, weights: str, scaling_factor: float, diffusion: GaussianDiffusion,
                      fingerprint: str, vae_fingerprint: Optional[str] = None) -> dict:
    """What makes a sample set: recorded with it, and compared on resume (other values are process layout)."""
    return {"checkpoint": str(args.checkpoint), "weights": weights, "weights_sha256": fingerprint,
            "model": dataclasses.asdict(spec), "sampler": args.sampler, "steps": args.steps, "spacing": args.spacing,
            "respacing": diffusion.respacing, "timesteps": diffusion.timestep_map.tolist(),
            "eta": args.eta if args.sampler == "ddim" else None,
            "cfg_scale": args.cfg_scale, "guided_channels": args.guided_channels if args.cfg_scale != 1.0 else None,
            "vae": spec.autoencoder, "vae_scaling_factor": scaling_factor, "vae_sha256": vae_fingerprint,
            "seed": args.seed,
            "num_samples": args.num_samples, "labels": "sample i has class i % num_classes",
            "batch_size": args.batch_size}


def check_resume(out_dir: Path, settings: dict) -> None:
    """Refuse to add samples to a directory whose finished chunks were made otherwise (options or weights)."""
    settings_file = out_dir / SETTINGS_FILE
    if not settings_file.is_file():
        if any((out_dir / "chunks").glob("chunk_*.npz")):
            raise SamplingError(f"{out_dir / 'chunks'} holds sample chunks but no {SETTINGS_FILE}, so nothing says "
                                "which weights and options made them; use a new --out-dir (or delete the chunks)")
        return
    old = json.loads(settings_file.read_text())
    # The weights are compared by content (weights_sha256); the path is only recorded, so a moved file resumes.
    diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k) and k != "checkpoint")
    if not diff:
        return
    if diff == ["weights_sha256"]:
        raise SamplingError(
            f"{out_dir} holds samples from other weights: {settings['checkpoint']} now holds weights with fingerprint "
            f"{settings['weights_sha256'][:16]}, the finished chunks came from {str(old['weights_sha256'])[:16]} (the "
            "file was replaced since, e.g. by a training run refreshing ema.safetensors). Use a new --out-dir, or "
            "restore the weights the chunks came from to resume")
    raise SamplingError(f"{out_dir} holds samples made with other settings ({', '.join(diff)} differ); "
                        "use a new --out-dir, or the same options to resume")


def run_num_samples(args, sampler: Sampler, state) -> Optional[dict]:
    """Generate samples ``0..N-1`` in chunks (rank r takes chunks r, r + W, ...), then assemble the outputs."""
    out_dir = Path(args.out_dir)
    settings = sampling_settings(args, sampler.spec, args.weights_used, sampler.decoder.scaling_factor,
                                 sampler.diffusion, args.weights_sha256, sampler.decoder.fingerprint)
    check_resume(out_dir, settings)
    state.wait_for_everyone()
    if state.is_main_process:
        (out_dir / "chunks").mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / SETTINGS_FILE, json.dumps(settings, indent=2))
    state.wait_for_everyone()

    n, b = args.num_samples, args.batch_size
    num_chunks = math.ceil(n / b)
    mine = [k for k in range(state.process_index, num_chunks, state.num_processes) if not chunk_path(out_dir, k).exists()]
    from tqdm.auto import tqdm

    for k in tqdm(mine, desc=f"chunks (process {state.process_index})", disable=not state.is_main_process or args.quiet):
        indices = torch.arange(k * b, min((k + 1) * b, n))
        labels = balanced_labels(indices, sampler.spec.num_classes)
        images = sampler(indices, labels).permute(0, 2, 3, 1).numpy()  # NHWC, as ADM stores them
        atomic_savez(chunk_path(out_dir, k), images=images, labels=labels.numpy(), indices=indices.numpy())
    state.wait_for_everyone()
    if not state.is_main_process:
        return None

    chunks = [chunk_path(out_dir, k) for k in range(num_chunks)]
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise SamplingError(f"chunks missing after sampling ({missing[:3]}...): do all processes share {out_dir}?")
    with np.load(chunks[0]) as first:
        image_shape = first["images"].shape[1:]
    protocol = {**settings, "num_processes": state.num_processes}
    outputs = {}
    if args.format in ("npz", "both"):
        outputs["npz"] = out_dir / "samples.npz"
        write_adm_npz(outputs["npz"], chunks, n, image_shape, protocol)
    if args.format in ("png", "both"):
        outputs["png"] = out_dir / "images"
        write_pngs(outputs["png"], chunks, protocol)
    atomic_write_text(out_dir / SAMPLING_PROTOCOL_FILE, json.dumps(protocol, indent=2))
    return {"outputs": {k: str(v) for k, v in outputs.items()}, "protocol": protocol}


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


def run_grid(args, sampler: Sampler) -> dict:
    num_classes = sampler.spec.num_classes
    if args.labels:
        labels = [int(v) for v in args.labels.split(",")]
    else:
        labels = list(DIT_SAMPLE_LABELS) if num_classes == 1000 else list(range(num_classes))
    bad = [v for v in labels if not 0 <= v < num_classes]
    if bad:
        raise SamplingError(f"--labels {bad} are outside [0, {num_classes}) for this model")
    images = torch.cat([sampler(torch.arange(i, min(i + args.batch_size, len(labels))),
                                torch.tensor(labels[i: i + args.batch_size]))
                        for i in range(0, len(labels), args.batch_size)])
    names = class_names(num_classes, pixel=sampler.spec.autoencoder == "none")
    path = write_grid(images, labels, args.grid, names, nrow=args.nrow)
    return {"grid": str(path), "labels": labels}


# ------------------------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m diffusion.sample", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="ema.safetensors / step_*.pt of diffusion.train, or a state dict")
    p.add_argument("--weights", default=None, help="entry of a training checkpoint to sample (default: ema)")
    out = p.add_argument_group("output (one of)")
    out.add_argument("--grid", default=None, help="write a PNG grid here (one sample per --labels entry)")
    out.add_argument("--num-samples", type=int, default=None, help="generate exactly N samples into --out-dir")
    out.add_argument("--labels", default=None, help="grid classes, comma-separated (default: DiT's 8, or all classes)")
    out.add_argument("--nrow", type=int, default=None, help="grid images per row")
    out.add_argument("--out-dir", default=None, help="--num-samples output directory (chunks, samples.npz, images/)")
    out.add_argument("--format", choices=("npz", "png", "both"), default="npz",
                     help="samples.npz (ADM format, for diffusion.fid), a PNG folder, or both")
    s = p.add_argument_group("sampling")
    s.add_argument("--sampler", choices=SAMPLERS, default="ddpm",
                   help="ddpm: ancestral, learned variance (DiT's FID setting); ddim: deterministic at --eta 0")
    s.add_argument("--steps", type=int, default=250, help="respaced sampling steps (DiT's FID-50K: 250)")
    s.add_argument("--spacing", choices=SPACINGS, default=None,
                   help="which steps: 'even' (ADM's \"N\": evenly spaced from 0 to T-1; default for ddpm) or 'ddim' "
                        "(ADM's \"ddimN\": stride T/N from 0; default for ddim, counts without an integer stride "
                        "are refused)")
    s.add_argument("--eta", type=float, default=0.0, help="DDIM noise (0: deterministic)")
    s.add_argument("--cfg-scale", type=float, default=1.0, help="classifier-free guidance scale (1: none)")
    s.add_argument("--guided-channels", default="3", help="epsilon channels guided: an int (official: 3) or 'all'")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--batch-size", type=int, default=64, help="samples per forward pass and per chunk file")
    m = p.add_argument_group("model (override what the checkpoint says; needed for plain state dicts)")
    m.add_argument("--model", default=None, help=f"one of {', '.join(DiT_models)}")
    m.add_argument("--topology", choices=DIT_TOPOLOGIES, default=None)
    m.add_argument("--image-size", type=int, default=None, help="image size in pixels (latents: /8)")
    m.add_argument("--num-classes", type=int, default=None)
    m.add_argument("--vae", default=None, help="AutoencoderKL directory or cached HF id; 'none' for pixel space")
    p.add_argument("--device", default=None, help="default: this process's accelerator device")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no JSON summary on stdout")
    return p.parse_args(argv)


def check_args(args) -> None:
    if (args.grid is None) == (args.num_samples is None):
        raise SamplingError("choose one output: --grid PATH.png, or --num-samples N with --out-dir DIR")
    if args.num_samples is not None:
        if args.num_samples < 1:
            raise SamplingError(f"--num-samples {args.num_samples} must be positive")
        if not args.out_dir:
            raise SamplingError("--num-samples needs --out-dir (where chunks and samples.npz go)")
    if args.batch_size < 1 or args.steps < 1:
        raise SamplingError("--batch-size and --steps must be positive")
    if args.guided_channels != "all" and not args.guided_channels.isdigit():
        raise SamplingError(f"--guided-channels {args.guided_channels!r}: an integer or 'all'")
    if args.spacing is None:
        args.spacing = "ddim" if args.sampler == "ddim" else "even"


def build_diffusion(args, learn_sigma: bool) -> GaussianDiffusion:
    try:
        return GaussianDiffusion(learn_sigma=learn_sigma, sampling_steps=args.steps, spacing=args.spacing)
    except ValueError as err:
        raise SamplingError(f"--steps {args.steps} --spacing {args.spacing}: {err}") from err


def main(argv=None) -> Optional[dict]:
    args = parse_args(argv)
    from accelerate import PartialState

    with one_line_errors(SamplingError, MetricsError):
        check_args(args)
        build_diffusion(args, learn_sigma=True)  # a step count the spacing cannot give fails before any loading
        state = PartialState(cpu=not torch.cuda.is_available())  # cpu=True joins a gloo group under torchrun
        device = args.device or str(state.device)
        use_fast_cuda_kernels()  # TF32 as DiT's sample.py, cudnn's autotuner for the VAE
        overrides = {"name": args.model, "topology": args.topology, "image_size": args.image_size,
                     "num_classes": args.num_classes, "autoencoder": args.vae}
        model, spec, args.weights_used = load_model(args.checkpoint, overrides, args.weights)
        args.weights_sha256 = weights_fingerprint(model.state_dict()) if args.num_samples is not None else None
        diffusion = build_diffusion(args, spec.learn_sigma)
        decoder = Decoder(spec.autoencoder, device, expect=dataclasses.asdict(spec) | {"vae": None})
        sampler = Sampler(model.to(device), spec, decoder, diffusion, args.sampler, args.eta,
                          args.cfg_scale, args.guided_channels, args.seed, device)
        if args.grid is not None:
            result = run_grid(args, sampler) if state.is_main_process else None
        else:
            result = run_num_samples(args, sampler, state)
    if result is not None and not args.quiet:
        print(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
