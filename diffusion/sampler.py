"""Sampling a DiT: per-sample noise streams, the reverse chain, guidance, the decoder, chunked sample sets with
resume, and readable grids. ``python -m diffusion.sample`` is the command line over this module; the trainer's grids
and in-training FID use the same :class:`Sampler`.

    model, spec, _ = load_dit("ema.safetensors")
    sampler = Sampler(model, spec, Decoder(spec.autoencoder, "cuda"), spec.diffusion(sampling_steps=250), device="cuda")
    images = sampler(torch.arange(8), torch.tensor([207, 360, 387, 974, 88, 979, 417, 279]))   # uint8 (8, 3, 256, 256)

Sample ``i`` draws its x_T and every step's noise from its own stream, seeded by ``(seed, i)`` (numpy's
``SeedSequence``): a sample is the same whatever batch, chunk or process it is drawn in. (Over 500 lines: the
sampler, both objectives' chains and the sample sets share these streams and are tested as one unit.)
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from common.checkpoint import weights_fingerprint
from common.cli import InputError
from common.data import pad_batch
from common.durable import atomic_savez, atomic_write, atomic_write_text
from common.preemption import stoppable_rounds
from diffusion.latents import LatentScaling, load_vae
from diffusion.transport import DIFFUSION_FORMS, LAST_STEPS, Transport, sde_step_size, shift_times, times

if TYPE_CHECKING:  # timm, diffusers, torch-fidelity: imported where they are used (the command line needs none)
    from diffusion.gaussian_diffusion import GaussianDiffusion
    from diffusion.models import DiT
    from diffusion.spec import DiTSpec

Tensor = torch.Tensor
SAMPLERS = ("ddpm", "ddim")  # a DDPM model's (GaussianDiffusion)
TRANSPORT_SAMPLERS = ("euler", "heun", "dopri5", "sde-euler", "sde-heun")  # a transport model's (Transport)
PRECISIONS = ("fp32", "bf16")
SETTINGS_FILE = "settings.json"
NOISE_WINDOW = 16  # reverse-chain draws per torch call and sample (a DiT-XL chunk of 64: 16 MB a window)


class SamplingError(InputError):
    """Options or checkpoints that cannot give the requested samples."""


# ------------------------------------------------------------------------------------------ noise and labels

_SEED_MASK = 0xFFFFFFFF
# numpy's SeedSequence constants (numpy/random/bit_generator.pyx): hashing entropy in, mixing the pool, drawing out
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715


def sample_seeds(seed: int, indices) -> np.ndarray:
    """``np.random.SeedSequence([seed, i]).generate_state(1)[0]`` for every index ``i`` at once (uint32).

    numpy's SeedSequence hashes its entropy words with fixed 32-bit multiply-xorshift rounds; for ``seed`` and
    indices below 2**32 the entropy is the two words ``[seed, i]``, and the same rounds run here on arrays.
    Larger values fall back to numpy itself.
    """
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if not (0 <= seed <= _SEED_MASK) or (idx.size and (idx.min() < 0 or idx.max() > _SEED_MASK)):
        return np.array([np.random.SeedSequence([int(seed), int(i)]).generate_state(1)[0] for i in idx], np.uint32)
    u32 = np.uint32
    hash_const = [_INIT_A]  # advances with every hash, the same for every sample

    def hashmix(value):
        value = value ^ u32(hash_const[0])
        hash_const[0] = (hash_const[0] * _MULT_A) & _SEED_MASK
        value = value * u32(hash_const[0])
        return value ^ (value >> u32(16))

    def mix(x, y):
        result = u32(_MIX_MULT_L) * x - u32(_MIX_MULT_R) * y
        return result ^ (result >> u32(16))

    words = [np.full(idx.shape, seed, u32), idx.astype(u32), np.zeros(idx.shape, u32), np.zeros(idx.shape, u32)]
    pool = [hashmix(w) for w in words]  # the pool of 4 words, each entropy word hashed in
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    state = (pool[0] ^ u32(_INIT_B)) * u32((_INIT_B * _MULT_B) & _SEED_MASK)  # generate_state(1): the first word
    return state ^ (state >> u32(16))


def sample_generators(seed: int, indices) -> List[torch.Generator]:
    """The noise stream of each global sample index: independent of batching and of the number of processes."""
    return [torch.Generator().manual_seed(int(s)) for s in sample_seeds(seed, indices)]


def sample_generator(seed: int, index: int) -> torch.Generator:
    return sample_generators(seed, [index])[0]


def draw_noise(generators: Sequence[torch.Generator], shape: Sequence[int]) -> Tensor:
    """One standard normal draw of ``shape`` from each sample's stream (on the CPU), stacked into a batch."""
    return torch.stack([torch.randn(tuple(shape), generator=g) for g in generators])


def chain_noise(generators: Sequence[torch.Generator], shape: Sequence[int], draws: int, device,
                window: int = NOISE_WINDOW) -> Iterator[Tensor]:
    """``draws`` successive :func:`draw_noise` batches, on ``device``, with the same numbers.

    Each sample's stream gives ``window`` draws per torch call: torch's CPU normal sampler fills blocks of 16
    values, so one draw of ``window * numel`` values is ``window`` draws of ``numel`` when 16 divides ``numel``
    (otherwise each draw is its own call). The next window is drawn by a worker thread while the chain runs on the
    current one, and on CUDA it goes through pinned memory with a non-blocking copy: the host never waits for the
    device to take the noise, and the device never waits for the host to draw it.
    """
    shape = tuple(shape)
    window = window if math.prod(shape) % 16 == 0 else 1
    device = torch.device(device)
    pinned = device.type == "cuda"
    sizes = [min(window, draws - done) for done in range(0, draws, window)]

    def draw(n: int) -> Tensor:
        buffer = torch.empty((len(generators), n, *shape), pin_memory=pinned)  # (B, draws, C, H, W)
        for row, g in zip(buffer, generators):
            torch.randn((n, *shape), generator=g, out=row)  # straight into the sample's contiguous rows
        return buffer

    with ThreadPoolExecutor(max_workers=1) as worker:
        pending = worker.submit(draw, sizes[0]) if sizes else None
        for k in range(len(sizes)):
            buffer = pending.result()
            if k + 1 < len(sizes):
                pending = worker.submit(draw, sizes[k + 1])
            block = buffer.to(device, non_blocking=pinned)  # (B, draws, C, H, W)
            for j in range(block.shape[1]):
                yield block[:, j]  # (B, C, H, W)


def balanced_labels(indices: Tensor, num_classes: int) -> Tensor:
    """Sample ``i`` gets class ``i % num_classes``: exactly N / num_classes per class when divisible."""
    return indices % num_classes


# --------------------------------------------------------------------------------------------- the chain

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


@torch.no_grad()
def reverse_chain(model_fn, diffusion: GaussianDiffusion, generators: Sequence[torch.Generator], shape: Sequence[int],
                  sampler: str = "ddpm", eta: float = 0.0, device="cpu") -> Iterator[Tensor]:
    """The reverse chain for one batch, state by state: yields x_T, then x after each respaced step (x_0 last).
    Sample ``b`` draws its x_T and step noise from ``generators[b]`` (:func:`chain_noise`).

    ``ddpm``: ancestral steps with the learned (or fixed) variance, :meth:`GaussianDiffusion.p_sample`;
    ``ddim``: :meth:`GaussianDiffusion.ddim_sample` with ``eta``.
    """
    if sampler not in SAMPLERS:
        raise SamplingError(f"sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    noise = chain_noise(generators, shape, diffusion.num_timesteps + 1, device)
    x = next(noise)
    yield x
    for i in range(diffusion.num_timesteps - 1, -1, -1):
        t = torch.full((x.shape[0],), i, device=device, dtype=torch.long)
        out = model_fn(x, diffusion.model_timesteps(t))
        if sampler == "ddpm":
            x = diffusion.p_sample(out, x, t, next(noise))["sample"]
        else:
            x = diffusion.ddim_sample(out, x, t, next(noise), eta)["sample"]
        yield x


def sample_loop(model_fn, diffusion: GaussianDiffusion, generators: Sequence[torch.Generator], shape: Sequence[int],
                sampler: str = "ddpm", eta: float = 0.0, device="cpu") -> Tensor:
    """x_0 of :func:`reverse_chain`."""
    for x in reverse_chain(model_fn, diffusion, generators, shape, sampler, eta, device):
        pass
    return x


# ------------------------------------------------------------------------------------ the transport's chain

@dataclass(frozen=True)
class FlowSampling:
    """How a transport model is sampled: SiT's samplers and their options, LightningDiT's timestep shift and the
    guidance interval of REPA and LightningDiT.

    ``steps`` is SiT's ``num_steps``: the time grid holds ``steps`` points from ``t0`` to ``t1``, so an ODE takes
    ``steps - 1`` Euler or Heun steps; an SDE takes ``steps - 1`` steps and then its last step (``last_step``,
    ``last_step_size``), ``steps`` network evaluations in all for Euler-Maruyama. ``dopri5`` (torchdiffeq) picks its
    own steps within ``atol``/``rtol`` and reports the grid's points. ``timestep_shift`` > 0 warps an ODE's grid by
    ``s t / (1 + (s - 1) t)``. Guidance applies where ``guidance_interval[0] <= t <= guidance_interval[1]`` (SiT's
    time: 1 is data; REPA's ``guidance_high=0.7`` is ``(0.3, 1)``, LightningDiT's ``cfg_interval_start=0.11`` is
    ``(0.11, 1)``), the plain conditional prediction elsewhere.
    """

    sampler: str = "sde-euler"
    steps: int = 250
    atol: float = 1e-6
    rtol: float = 1e-3
    diffusion_form: str = "sigma"
    diffusion_norm: float = 1.0
    last_step: str = "mean"
    last_step_size: float = 0.04
    timestep_shift: float = 0.0
    guidance_interval: Tuple[float, float] = (0.0, 1.0)

    def __post_init__(self):
        checks = ((self.sampler, TRANSPORT_SAMPLERS, "sampler"), (self.diffusion_form, DIFFUSION_FORMS, "diffusion form"),
                  (self.last_step, LAST_STEPS, "last step"))
        for value, allowed, what in checks:
            if value not in allowed:
                raise SamplingError(f"{what} {value!r} for a transport model; choose one of {', '.join(allowed)}")
        if self.steps < 2:
            raise SamplingError(f"steps={self.steps}: a transport sampler's time grid needs at least 2 points")
        lo, hi = self.guidance_interval
        if not 0.0 <= lo <= hi <= 1.0:
            raise SamplingError(f"guidance interval ({lo}, {hi}): need 0 <= low <= high <= 1 (t = 1 is data)")
        if self.timestep_shift and self.sde:
            raise SamplingError("the timestep shift warps an ODE's time grid (LightningDiT); choose an ODE sampler "
                                "(euler, heun, dopri5) or timestep shift 0")
        if self.timestep_shift < 0 or self.last_step_size < 0 or self.atol <= 0 or self.rtol <= 0:
            raise SamplingError("timestep shift, last step size, atol and rtol must be non-negative (tolerances positive)")

    @property
    def sde(self) -> bool:
        return self.sampler.startswith("sde-")

    def applies(self, option: str) -> bool:
        """Whether this sampler reads ``option``: the SDE's settings only the SDEs, the tolerances only dopri5."""
        if option in ("diffusion_form", "diffusion_norm", "last_step", "last_step_size"):
            return self.sde
        return self.sampler == "dopri5" if option in ("atol", "rtol") else True

    def time_grid(self, transport: Transport) -> Tensor:
        """The ``steps`` times the chain visits (float32, as SiT's ``linspace``)."""
        if self.sde:
            size = 0.0 if self.last_step == "none" else self.last_step_size
            t0, t1 = transport.interval(transport.sample_eps, sde=True, diffusion_form=self.diffusion_form,
                                        last_step_size=size)
            if self.diffusion_form == "SBDM" and t0 == 0 and transport.path_name != "vp":
                raise SamplingError(f"SBDM diffusion is infinite at t = 0 on the {transport.path_name} path, where a "
                                    "velocity model's SDE starts (SiT returns NaN there); use diffusion form sigma")
            if self.sampler == "sde-heun" and t1 == 1 and transport.path_name == "linear":
                raise SamplingError("sde-heun without a last step ends with a drift at t = 1, where a velocity model's "
                                    "score on the linear path is 0/0 (SiT returns NaN there); use last step mean or "
                                    "sampler sde-euler")
            return torch.linspace(t0, t1, self.steps)
        t0, t1 = transport.interval(transport.sample_eps)
        return shift_times(torch.linspace(t0, t1, self.steps), self.timestep_shift)

    def settings(self, transport: Transport) -> dict:
        """What the sampling protocol records: the options that apply to this sampler, and the grid."""
        used = {k: v for k, v in asdict(self).items() if self.applies(k)}
        used["guidance_interval"] = list(self.guidance_interval)
        return {**used, "time_grid": self.time_grid(transport).tolist()}


def transport_predict(model: DiT, labels: Tensor, cfg_scale: float = 1.0, guided_channels=None,
                      interval: Tuple[float, float] = (0.0, 1.0)) -> Callable[[Tensor, float], Tensor]:
    """``(x_t, t) -> prediction`` for ``labels`` at the host-side time ``t``: guided inside ``interval`` (when
    ``cfg_scale != 1``), the plain conditional forward outside it; of a learned-sigma network's ``2C`` channels the
    first ``C`` (SiT's checkpoints hold ``2C`` and use half)."""
    plain = model_fn_for(model, labels)
    guided = model_fn_for(model, labels, cfg_scale, guided_channels)
    channels, (low, high) = model.in_channels, interval

    def predict(x: Tensor, t: float) -> Tensor:
        fn = guided if low <= t <= high else plain
        return fn(x, times(x, t))[:, :channels]

    return predict


@torch.no_grad()
def transport_chain(predict, transport: Transport, options: FlowSampling, generators: Sequence[torch.Generator],
                    shape: Sequence[int], device="cpu") -> Iterator[Tensor]:
    """The transport's chain for one batch from noise (``t0``) to data: yields x at ``t0``, then after every step
    (an SDE's last step last). Sample ``b`` draws its start and its SDE noise from ``generators[b]``."""
    grid_tensor = options.time_grid(transport)
    grid = grid_tensor.tolist()
    noise = chain_noise(generators, shape, len(grid) if options.sde else 1, device)
    x = next(noise)
    yield x
    if options.sampler == "dopri5":
        from torchdiffeq import odeint

        def field(t: Tensor, state: Tensor) -> Tensor:
            t = float(t)  # the solver's own times: one host read per evaluation, as the solver itself makes
            return transport.velocity(predict(state, t), state, times(state, t))

        states = odeint(field, x, torch.tensor(grid, device=x.device), method="dopri5", atol=options.atol,
                        rtol=options.rtol)
        yield from states[1:]
        return
    sde_dt = sde_step_size(grid_tensor) if options.sde else None
    for t, t_next in zip(grid[:-1], grid[1:]):
        dt = t_next - t if sde_dt is None else sde_dt
        if options.sampler == "euler":
            x = transport.euler_step(predict, x, t, dt)
        elif options.sampler == "heun":
            x = transport.heun_step(predict, x, t, dt)
        elif options.sampler == "sde-euler":
            x = transport.sde_euler_step(predict, x, t, dt, next(noise), options.diffusion_form, options.diffusion_norm)
        else:
            x = transport.sde_heun_step(predict, x, t, dt, next(noise), options.diffusion_form, options.diffusion_norm)
        yield x
    if options.sde and options.last_step != "none":
        yield transport.last_step(predict, x, grid[-1], options.last_step_size, options.last_step,
                                  options.diffusion_form, options.diffusion_norm)


def sampling_objective(spec: DiTSpec, steps: int, sampler: Optional[str] = None, spacing: Optional[str] = None,
                       **flow_options):
    """``(objective, sampler, flow)`` to sample a model as it was trained: its :class:`GaussianDiffusion` respaced
    to ``steps`` (``sampler`` ``ddpm``, the default, or ``ddim``; ``spacing`` by default ``even`` for ddpm and
    ``ddim`` for ddim), or its :class:`Transport` with :class:`FlowSampling` (``sampler`` by default ``sde-euler``,
    SiT's FID sampler; ``flow_options`` its other settings)."""
    if spec.transport is not None:
        if sampler in SAMPLERS or spacing is not None:
            raise SamplingError(f"this model was trained with SiT's transport ({spec.transport['path']} path, "
                                f"{spec.transport['prediction']} prediction): sample it with "
                                f"{', '.join(TRANSPORT_SAMPLERS)} (no --spacing)")
        flow = FlowSampling(sampler=sampler or "sde-euler", steps=steps, **flow_options)
        ignored = ["--" + k.replace("_", "-") for k in flow_options if not flow.applies(k)]
        if ignored:
            it = "them" if len(ignored) > 1 else "it"
            raise SamplingError(f"{', '.join(ignored)}: --sampler {flow.sampler} does not read {it} (--atol and --rtol "
                                "set dopri5's adaptive steps, --diffusion-* and --last-step* the SDE samplers', "
                                f"sde-euler and sde-heun); drop {it}, or choose a --sampler that reads {it}")
        return Transport.from_description(spec.transport), flow.sampler, flow
    if sampler in TRANSPORT_SAMPLERS or flow_options:
        given = [f"sampler {sampler}"] * (sampler in TRANSPORT_SAMPLERS) + [k.replace("_", " ") for k in sorted(flow_options)]
        raise SamplingError(f"this model was trained with DDPM: sample it with {' or '.join(SAMPLERS)}; "
                            f"{', '.join(given)}: a transport model's options (SiT's)")
    sampler = sampler or "ddpm"
    spacing = spacing or ("ddim" if sampler == "ddim" else "even")
    try:
        return spec.diffusion(sampling_steps=steps, spacing=spacing), sampler, None
    except ValueError as err:
        raise SamplingError(f"--steps {steps} --spacing {spacing}: {err}") from err


def autocast(device, precision: str):
    """The model's forward in ``precision``: ``bf16`` autocast (its matmuls in bfloat16; the streams, the model
    output and the chain arithmetic stay float32) or plain ``fp32``."""
    if precision not in PRECISIONS:
        raise SamplingError(f"precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------------------------- decoding

class VAEMismatchError(SamplingError):
    """The VAE given is not the one the latents (and so the model) were made with."""


class Decoder:
    """Model outputs -> uint8 images ``[B, C, H, W]``: through the VAE (``x / scaling_factor``, or with
    ``latent_norm``, the model's record of LightningDiT's per-channel normalisation, ``x * std / multiplier + mean``:
    :class:`~diffusion.latents.LatentScaling`) or as pixels.

    ``expect`` (``vae``, ``vae_sha256``, ``vae_scaling_factor``, as the latents' metadata and the model's weights
    record them) is checked against the loaded VAE: decoding with another VAE gives wrong images without an error.
    ``nonfinite="raise"`` refuses NaN/inf samples; ``"black"`` draws them black and counts them in
    :attr:`nonfinite_images` (training grids and FIDs, which must never stop a run).
    """

    def __init__(self, autoencoder: str, device, option: str = "--vae", expect: Optional[dict] = None,
                 nonfinite: str = "raise", made_with: str = "the model was trained on",
                 latent_norm: Optional[dict] = None):
        self.vae, self.scaling_factor, self.fingerprint = None, 1.0, None
        self.nonfinite, self.nonfinite_images = nonfinite, 0
        if autoencoder != "none":
            vae = load_vae(autoencoder, option=option)
            self.fingerprint = weights_fingerprint(vae.state_dict())
            self.scaling_factor = float(vae.config.scaling_factor)
            self._check(autoencoder, option, expect or {}, made_with)
            self.vae = vae.to(device).eval().requires_grad_(False)
        self.scaling = LatentScaling(self.scaling_factor, latent_norm)

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

    def compile(self) -> None:
        """``torch.compile`` the VAE's decoder in place (fixed shapes: the sampler pads its last batch)."""
        if self.vae is not None:
            self.vae.decoder.compile(dynamic=False)

    @torch.no_grad()
    def __call__(self, x: Tensor) -> Tensor:
        if self.vae is not None:
            x = self.vae.decode(self.scaling.undo(x)).sample
        x = x.float()
        if self.nonfinite == "black":
            finite = torch.isfinite(x)
            self.nonfinite_images += int((~finite).flatten(1).any(dim=1).sum())
            x = torch.where(finite, x, -1.0)
        from diffusion.evaluation.images import images_to_uint8

        return images_to_uint8(x.clamp(-1.0, 1.0).cpu())  # with nonfinite="raise", NaN samples raise here


@dataclass
class Sampler:
    """A model, its objective and decoder, and the sampling options: ``sampler(indices, labels) -> uint8``.

    ``diffusion`` is the model's :class:`GaussianDiffusion` (DDPM, sampled by ``sampler`` ``ddpm`` or ``ddim``) or its
    :class:`~diffusion.transport.Transport` (sampled as ``flow`` says; ``sampler`` is ``flow.sampler``).
    ``compile``: ``torch.compile`` the model and the VAE's decoder in place, once, for the shapes of the first batch;
    a smaller batch (the last of a set) is padded to that size with copies of its last sample and cut back, so
    nothing compiles twice. Each sample's noise comes from its own stream, so padding changes no sample.
    """

    model: DiT
    spec: DiTSpec
    decoder: Decoder
    diffusion: Union[GaussianDiffusion, Transport]
    sampler: str = "ddpm"
    eta: float = 0.0
    cfg_scale: float = 1.0
    guided_channels: Optional[str] = None  # None: resolve_guided_channels's default for the model
    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"
    flow: Optional[FlowSampling] = None
    compile: bool = False

    def __post_init__(self):
        if isinstance(self.diffusion, Transport):
            self.flow = self.flow or FlowSampling()
            self.sampler = self.flow.sampler
        else:
            self.diffusion.to(self.device)  # the schedule next to the model: no host-to-device copy per step
        self.guided_channels = resolve_guided_channels(self.guided_channels, self.model.in_channels)
        autocast(self.device, self.precision)  # an unknown precision fails here, before any sampling
        self.compiled_batch: Optional[int] = None
        if self.compile:
            self.model.compile(dynamic=False)
            self.decoder.compile()

    def __call__(self, indices: Tensor, labels: Tensor) -> Tensor:
        """uint8 images ``[B, C, H, W]`` of samples ``indices`` (their noise streams) of classes ``labels``."""
        count = len(indices)
        if self.compile:
            self.compiled_batch = self.compiled_batch or count
            indices, labels = pad_batch(indices, self.compiled_batch), pad_batch(labels, self.compiled_batch)
        return self.decoder(self.latents(indices, labels))[:count]

    def latents(self, indices: Tensor, labels: Tensor) -> Tensor:
        """The chain's end (VAE latents, or pixels in [-1, 1]) for samples ``indices`` of classes ``labels``."""
        generators = sample_generators(self.seed, indices.tolist())
        labels = labels.to(self.device)
        if isinstance(self.diffusion, Transport):
            predict = transport_predict(self.model, labels, self.cfg_scale, self.guided_channels,
                                        self.flow.guidance_interval)

            def forward(x, t):
                with autocast(self.device, self.precision):
                    return predict(x, t)

            for x in transport_chain(forward, self.diffusion, self.flow, generators, self.spec.shape, self.device):
                pass
            return x
        model_fn = model_fn_for(self.model, labels, self.cfg_scale, self.guided_channels)

        def forward(x, t):
            with autocast(self.device, self.precision):
                return model_fn(x, t)

        return sample_loop(forward, self.diffusion, generators, self.spec.shape, self.sampler, self.eta, self.device)

    def settings(self) -> dict:
        """What this sampler makes a sample set with: recorded with the set, compared on resume."""
        guided = self.cfg_scale != 1.0
        model = {k: v for k, v in vars(self.spec).items() if k != "class_names"}
        if isinstance(self.diffusion, Transport):
            chain = {"objective": self.diffusion.description(), **self.flow.settings(self.diffusion)}
        else:
            chain = {"sampler": self.sampler, "respacing": self.diffusion.respacing,
                     "timesteps": self.diffusion.timestep_map.tolist(),
                     "eta": self.eta if self.sampler == "ddim" else None}
        return {"model": model, **chain,
                "cfg_scale": self.cfg_scale, "guided_channels": self.guided_channels if guided else None,
                "precision": self.precision, "vae": self.spec.autoencoder,
                "vae_scaling_factor": self.decoder.scaling_factor, "vae_sha256": self.decoder.fingerprint,
                "seed": self.seed, "labels": "sample i has class i % num_classes"}


# ------------------------------------------------------------------------------------- chunked sample sets

def chunk_path(out_dir: Path, k: int) -> Path:
    return out_dir / "chunks" / f"chunk_{k:06d}.npz"


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def write_adm_npz(path: Path, chunk_files: Sequence[Path], count: int, image_shape: Sequence[int], protocol: dict) -> None:
    """``arr_0`` (uint8 [N, H, W, C]), ``arr_1`` (labels) and the protocol, streamed chunk by chunk, so the
    file can be larger than memory (np.savez needs the whole array)."""
    from diffusion.evaluation.images import SAMPLING_PROTOCOL_KEY

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

    from diffusion.evaluation.images import SAMPLING_PROTOCOL_FILE

    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.tmp"):  # a kill while writing a PNG leaves only its temporary file
        stale.unlink()
    for chunk in chunk_files:
        with np.load(chunk) as data:
            for index, image in zip(data["indices"], data["images"]):
                with atomic_write(folder / f"{int(index):06d}.png") as tmp:
                    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(tmp, format="PNG")
    atomic_write_text(folder / SAMPLING_PROTOCOL_FILE, json.dumps(protocol, indent=2))


def held_samples(out_dir: Path) -> List[Path]:
    """What a sample set in ``out_dir`` holds so far: its chunks, ``samples.npz`` and PNGs (the first of each)."""
    found = [next(out_dir.glob(pattern), None) for pattern in ("chunks/chunk_*.npz", "samples.npz", "images/*.png")]
    return [p for p in found if p is not None]


def check_resume(out_dir: Path, settings: dict) -> None:
    """Refuse to add samples to a directory whose samples were made otherwise (options or weights). The settings of
    a command that ended before its first chunk bind nothing: a folder without samples takes the new settings."""
    settings_file = out_dir / SETTINGS_FILE
    held = held_samples(out_dir)
    if not settings_file.is_file():
        if held:
            raise SamplingError(f"{out_dir} holds samples ({held[0].relative_to(out_dir)}) but no {SETTINGS_FILE}, so "
                                "nothing says which weights and options made them; use a new --out-dir (or delete "
                                "them)")
        return
    if not held:
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


def write_sample_set(sampler: Sampler, out_dir, num_samples: int, batch_size: int, settings: dict, state,
                     formats: Sequence[str] = ("npz",), progress: bool = True,
                     stop_signals: Sequence[str] = ()) -> Optional[dict]:
    """Samples ``0..N-1`` in chunks of ``batch_size`` (process r of ``state`` takes chunks r, r + W, ...), each
    written to ``out_dir/chunks/`` as it finishes, then ``samples.npz`` (``"npz"``) and ``images/`` (``"png"``).

    ``settings`` (what makes the set, :meth:`Sampler.settings` plus the caller's) go to ``settings.json``; a rerun
    with the same settings only samples the chunks still missing, one with other settings is refused.
    ``stop_signals`` (a command line's: SIGTERM, SIGUSR1): the processes stop together after a round of one chunk
    each (:func:`common.preemption.stoppable_rounds`, which raises ``WorkStopped``), their chunks written.
    Returns ``{"outputs", "protocol"}`` on the main process, None on the others.
    """
    out_dir = Path(out_dir)
    check_resume(out_dir, settings)
    state.wait_for_everyone()
    if state.is_main_process:
        (out_dir / "chunks").mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / SETTINGS_FILE, json.dumps(settings, indent=2))
    state.wait_for_everyone()

    world, rank = state.num_processes, state.process_index
    num_chunks = math.ceil(num_samples / batch_size)
    todo = {k for k in range(rank, num_chunks, world) if not chunk_path(out_dir, k).exists()}
    from tqdm.auto import tqdm

    quiet = not state.is_main_process or not progress
    with tqdm(total=len(todo), desc=f"chunks (process {rank})", disable=quiet) as bar:
        for round_ in stoppable_rounds(math.ceil(num_chunks / world), stop_signals, world, rank, unit="chunks"):
            k = round_ * world + rank
            if k in todo:
                indices = torch.arange(k * batch_size, min((k + 1) * batch_size, num_samples))
                labels = balanced_labels(indices, sampler.spec.num_classes)
                images = sampler(indices, labels).permute(0, 2, 3, 1).numpy()  # NHWC, as ADM stores them
                atomic_savez(chunk_path(out_dir, k), images=images, labels=labels.numpy(), indices=indices.numpy())
                bar.update(1)
    state.wait_for_everyone()
    if not state.is_main_process:
        return None

    from diffusion.evaluation.images import SAMPLING_PROTOCOL_FILE

    chunks = [chunk_path(out_dir, k) for k in range(num_chunks)]
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise SamplingError(f"chunks missing after sampling ({missing[:3]}...): do all processes share {out_dir}?")
    with np.load(chunks[0]) as first:
        image_shape = first["images"].shape[1:]
    protocol = {**settings, "num_processes": state.num_processes}
    outputs = {}
    if "npz" in formats:
        outputs["npz"] = out_dir / "samples.npz"
        write_adm_npz(outputs["npz"], chunks, num_samples, image_shape, protocol)
    if "png" in formats:
        outputs["png"] = out_dir / "images"
        write_pngs(outputs["png"], chunks, protocol)
    atomic_write_text(out_dir / SAMPLING_PROTOCOL_FILE, json.dumps(protocol, indent=2))
    return {"outputs": {k: str(v) for k, v in outputs.items()}, "protocol": protocol}


# ------------------------------------------------------------------------------------------------- grids

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
