"""The objectives' sampling chains, each a loop of its objective's step rules over one batch: DDPM's reverse chain
(ancestral or DDIM steps, :class:`DDPMSampling`) and the transport's ODE or SDE (SiT's samplers,
:class:`FlowSampling`). Sample ``b`` draws its start and its steps' noise from its own stream
(:func:`diffusion.sampling.noise.chain_noise`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, Tuple, Union

import torch

from diffusion.sampling.guidance import model_fn_for
from diffusion.sampling.noise import chain_noise
from diffusion.sampling.options import SAMPLERS, TRANSPORT_SAMPLERS, SamplingError
from diffusion.transport import DIFFUSION_FORMS, LAST_STEPS, Transport, sde_step_size, shift_times, times

if TYPE_CHECKING:
    from diffusion.gaussian_diffusion import GaussianDiffusion
    from diffusion.models import DiT
    from diffusion.objective import Objective

Tensor = torch.Tensor


@dataclass(frozen=True)
class DDPMSampling:
    """How a DDPM model is sampled: ``ddpm`` (ancestral steps with the learned or fixed variance) or ``ddim``
    (with ``eta``, its noise)."""

    sampler: str = "ddpm"
    eta: float = 0.0
    spacing: str = "even"  # the respacing rule the objective was built with (recorded with a sample set)

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise SamplingError(f"sampler {self.sampler!r}; choose one of {', '.join(SAMPLERS)}")

    def model_fn(self, model: DiT, labels: Tensor, cfg_scale: float, guided_channels) -> Callable:
        """``(x_t, timesteps) -> output`` for ``labels``, guided when ``cfg_scale != 1``."""
        return model_fn_for(model, labels, cfg_scale, guided_channels)

    def states(self, diffusion: GaussianDiffusion, model_fn: Callable, generators: Sequence[torch.Generator],
               shape: Sequence[int], device) -> Iterator[Tensor]:
        return reverse_chain(model_fn, diffusion, generators, shape, self.sampler, self.eta, device)

    def settings(self, diffusion: GaussianDiffusion) -> dict:
        """What a sample set records of the chain (compared on resume)."""
        return {"sampler": self.sampler, "respacing": diffusion.respacing, "timesteps": diffusion.timestep_map.tolist(),
                "eta": self.eta if self.sampler == "ddim" else None}


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

    def model_fn(self, model: DiT, labels: Tensor, cfg_scale: float, guided_channels) -> Callable:
        """``(x_t, t) -> prediction``, guided inside the guidance interval (:func:`transport_predict`)."""
        return transport_predict(model, labels, cfg_scale, guided_channels, self.guidance_interval)

    def states(self, transport: Transport, model_fn: Callable, generators: Sequence[torch.Generator],
               shape: Sequence[int], device) -> Iterator[Tensor]:
        return transport_chain(model_fn, transport, self, generators, shape, device)

    def settings(self, transport: Transport) -> dict:
        """What a sample set records: the objective, the options that apply to this sampler, and the grid."""
        used = {k: v for k, v in asdict(self).items() if self.applies(k)}
        used["guidance_interval"] = list(self.guidance_interval)
        return {"objective": transport.description(), **used, "time_grid": self.time_grid(transport).tolist()}


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


def default_sampling(objective: Objective) -> Union[DDPMSampling, FlowSampling]:
    """The sampling options of the objective's own paper: its ``default_sampler`` with every other option at its
    default."""
    sampler = objective.default_sampler
    return DDPMSampling(sampler) if sampler in SAMPLERS else FlowSampling(sampler)
