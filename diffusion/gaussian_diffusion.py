"""Gaussian diffusion as DiT trains and samples it (docs/method.md section 4), every step rule side by side.

A linear beta schedule (the recipe's length and betas; DiT's: 1000 steps, 1e-4..0.02), the network predicts the
noise ``eps`` and, with
``learn_sigma=True``, a second set of channels ``v`` in [-1, 1] that interpolates the log-variance of
each reverse step between the posterior variance and ``beta_t`` ("learned range", Nichol & Dhariwal).
The training loss is ``MSE(eps) + VLB`` where the VLB term sees the predicted mean with its gradient
stopped, so it trains the variance only. ``learn_sigma=False`` trains plain MSE and samples with the
fixed "large" variance ``beta_t``.

The schedule (betas, cumulative alphas, ``add_noise``) comes from diffusers' :class:`~diffusers.DDPMScheduler`;
diffusers has no variational bound and its learned-range variance differs from ADM's at ``t=0`` (where the
VLB's decoder term lives), so the posterior, the reverse-step parameters and the VLB are written here, as pure
functions of tensors.

Timestep respacing (``sampling_steps=250``) keeps a subset of the 1000 training timesteps and
recomputes the betas between them; ``t`` passed to this module's methods then indexes the *respaced*
steps, and :meth:`GaussianDiffusion.model_timesteps` maps them back to the training timesteps the
network is conditioned on. Which steps are kept follows ADM's ``space_timesteps`` (see
:func:`respaced_timesteps`): ``"N"`` (``spacing="even"``, DDPM's convention) or ``"ddimN"``
(``spacing="ddim"``, the DDIM paper's integer stride). diffusers' ``timestep_spacing="linspace"`` is not
used: it rounds ``linspace(0, T-1, N)`` where ADM accumulates a float stride, and the two differ for 278 of
the 1000 possible counts (e.g. 21; they agree for 250).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Union

import torch

from diffusion.objective import model_and_extra

Tensor = torch.Tensor
LOG2 = math.log(2.0)


def extract(coefficients: Tensor, t: Tensor, like: Tensor) -> Tensor:
    """Per-sample schedule value ``coefficients[t]``, shaped to broadcast against ``like`` (B, ...)."""
    out = coefficients.to(device=t.device)[t].to(like.dtype)
    return out.reshape(t.shape[0], *([1] * (like.ndim - 1)))


def mean_flat(x: Tensor) -> Tensor:
    """Mean over all but the batch dimension."""
    return x.mean(dim=tuple(range(1, x.ndim)))


def normal_kl(mean1: Tensor, logvar1: Tensor, mean2: Tensor, logvar2: Tensor) -> Tensor:
    """Elementwise KL( N(mean1, exp(logvar1)) || N(mean2, exp(logvar2)) ) in nats."""
    return 0.5 * (logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2) - 1.0)


def discretized_gaussian_log_likelihood(x: Tensor, mean: Tensor, log_scale: Tensor, bins: int = 256) -> Tensor:
    """Elementwise log-probability of data ``x`` in [-1, 1], quantised to ``bins`` levels, under
    N(mean, exp(log_scale)^2); the outermost bins extend to -inf / +inf.

    Uses the exact normal CDF (``torch.special``) where ADM uses a tanh approximation; the two agree
    to ~1e-3 in the CDF and this term only exists at t=0.
    """
    half_bin = 1.0 / (bins - 1)
    inv_std = torch.exp(-log_scale)
    upper = inv_std * (x - mean + half_bin)
    lower = inv_std * (x - mean - half_bin)
    log_cdf_upper = torch.special.log_ndtr(upper)  # log P(z < upper): the lowest bin
    log_sf_lower = torch.special.log_ndtr(-lower)  # log P(z > lower): the highest bin
    # The bin mass from the tail that keeps it representable: upper bins via the survival function.
    mass = torch.where(
        lower > 0,
        torch.special.ndtr(-lower) - torch.special.ndtr(-upper),
        torch.special.ndtr(upper) - torch.special.ndtr(lower),
    )
    log_mass = torch.log(mass.clamp(min=1e-12))
    return torch.where(x < -1.0 + 1e-3, log_cdf_upper, torch.where(x > 1.0 - 1e-3, log_sf_lower, log_mass))


SPACINGS = ("even", "ddim")
# The published DiT's schedule (facebookresearch/DiT): what a checkpoint that records none was trained with.
# Recipes set their own in configs/; the sampler reads it from the weights' metadata.
DIT_SCHEDULE = {"num_train_timesteps": 1000, "beta_start": 1e-4, "beta_end": 0.02}


def respaced_timesteps(num_timesteps: int, respacing: Union[int, str]) -> List[int]:
    """The training timesteps kept by ADM's respacing rule ``respacing``, in increasing order.

    * ``"N"`` (or the int N): N steps as evenly spaced as rounding allows, from 0 to ``num_timesteps - 1``
      (``"250"`` over 1000: 0, 4, 8, ..., 999);
    * ``"a,b,c"``: the steps are cut into equal sections (the first ones one longer when it does not divide) and
      section ``i`` gets ``counts[i]`` evenly spaced steps;
    * ``"ddimN"``: ``range(0, num_timesteps, stride)`` with the smallest integer stride that gives exactly N
      steps (``"ddim50"``: 0, 20, ..., 980); counts that no integer stride gives are an error, as in ADM.

    The evenly spaced positions accumulate the float stride (``position += stride``) and round half to even,
    exactly as ADM does: the steps a given count selects are ADM's, ties included.
    """
    spec = str(respacing).strip()
    if spec.startswith("ddim"):
        try:
            count = int(spec[len("ddim"):])
        except ValueError:
            raise ValueError(f"respacing {spec!r}: 'ddim' must be followed by a number of steps, e.g. ddim50") from None
        for stride in range(1, num_timesteps):  # the smallest stride wins, as in ADM
            if math.ceil(num_timesteps / stride) == count:
                return list(range(0, num_timesteps, stride))
        possible = sorted({math.ceil(num_timesteps / s) for s in range(1, num_timesteps)})
        near = sorted(possible, key=lambda c: abs(c - count))[:2]
        raise ValueError(
            f"{count} DDIM steps: no integer stride gives exactly {count} of {num_timesteps} steps (ADM's ddim{count} "
            f"is undefined); use {' or '.join(map(str, sorted(near)))} steps, or the evenly spaced rule "
            f"(spacing 'even')"
        )
    try:
        counts = [int(c) for c in spec.split(",")]
    except ValueError:
        raise ValueError(f"respacing {spec!r}: expected a step count (250), counts per section (10,15,20) "
                         "or ddimN") from None
    if any(c < 0 for c in counts) or sum(counts) < 1:
        raise ValueError(f"respacing {spec!r}: step counts must be non-negative and keep at least one step")
    section, longer = divmod(num_timesteps, len(counts))
    kept, start = set(), 0
    for i, count in enumerate(counts):
        size = section + (1 if i < longer else 0)
        if count > size:
            raise ValueError(f"respacing {spec!r}: a section of {size} training steps cannot hold {count} steps")
        stride = (size - 1) / (count - 1) if count > 1 else 1
        position = 0.0
        for _ in range(count):
            kept.add(start + round(position))
            position += stride
        start += size
    return sorted(kept)


def respacing_string(steps: Union[int, str, None], spacing: str, num_timesteps: int) -> str:
    """ADM's name of a respacing: ``(50, "ddim") -> "ddim50"``, ``(250, "even") -> "250"``; strings pass through."""
    if spacing not in SPACINGS:
        raise ValueError(f"spacing {spacing!r}; choose one of {', '.join(SPACINGS)}")
    if steps is None:
        steps = num_timesteps
    if isinstance(steps, str):
        if spacing != "even":
            raise ValueError(f"respacing string {steps!r} already says its rule: leave spacing at 'even'")
        return steps.strip()
    if not 1 <= steps <= num_timesteps:
        raise ValueError(f"sampling_steps={steps} must lie in [1, {num_timesteps}]")
    return f"ddim{steps}" if spacing == "ddim" else str(steps)


class GaussianDiffusion:
    """DDPM schedule, posterior, the reverse steps (DDPM and DDIM) and DiT's training loss.

    Args:
        num_train_timesteps: length of the training chain.
        beta_start, beta_end: the linear beta schedule (:data:`DIT_SCHEDULE` for the published DiT's).
        learn_sigma: the model outputs ``2C`` channels (eps and the variance interpolation ``v``).
        sampling_steps: respace to this many steps (``None`` = all training steps), or an ADM respacing
            string (``"250"``, ``"ddim50"``, ``"10,15,20"``); see :func:`respaced_timesteps`.
        spacing: for an int ``sampling_steps``: ``"even"`` (ADM's ``"N"``, DDPM's convention) or ``"ddim"``
            (ADM's ``"ddimN"``, the DDIM convention).
    """

    def __init__(
        self,
        num_train_timesteps: int,
        beta_start: float,
        beta_end: float,
        learn_sigma: bool,
        sampling_steps: Optional[Union[int, str]] = None,
        spacing: str = "even",
    ):
        self.learn_sigma = learn_sigma
        self.num_train_timesteps = num_train_timesteps
        self.beta_start, self.beta_end = beta_start, beta_end
        from diffusers import DDPMScheduler  # imported here: the sampler's command line reads SPACINGS without it

        self.scheduler = DDPMScheduler(
            num_train_timesteps=num_train_timesteps,
            beta_schedule="linear",
            beta_start=beta_start,
            beta_end=beta_end,
            prediction_type="epsilon",
            clip_sample=False,
        )
        # diffusers keeps the schedule in float32; the posterior and the VLB need float64 (as ADM).
        train_alphas_cumprod = torch.cumprod(1.0 - self.scheduler.betas.double(), dim=0)
        self.respacing = respacing_string(sampling_steps, spacing, num_train_timesteps)  # ADM's name, e.g. "ddim50"
        kept = torch.tensor(respaced_timesteps(num_train_timesteps, self.respacing), dtype=torch.long)
        self.timestep_map = kept  # respaced index -> training timestep the model is conditioned on
        self.num_timesteps = len(kept)

        # Respacing keeps alphas_cumprod at the kept steps and recomputes the betas between them.
        alphas_cumprod = train_alphas_cumprod[kept]
        alphas_cumprod_prev = torch.cat([alphas_cumprod.new_ones(1), alphas_cumprod[:-1]])
        betas = 1.0 - alphas_cumprod / alphas_cumprod_prev
        self.betas = betas
        self.alphas_cumprod = alphas_cumprod
        self.alphas_cumprod_prev = alphas_cumprod_prev
        self.sqrt_recip_alphas_cumprod = torch.sqrt(1.0 / alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = torch.sqrt(1.0 / alphas_cumprod - 1.0)
        # Posterior q(x_{t-1} | x_t, x_0).
        self.posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        # The posterior variance is 0 at t=0; like ADM, use the t=1 value there so the log stays finite.
        self.posterior_log_variance_clipped = torch.log(
            torch.cat([self.posterior_variance[1:2], self.posterior_variance[1:]])
        )
        self.posterior_mean_coef1 = betas * torch.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - alphas_cumprod_prev) * torch.sqrt(1.0 - betas) / (1.0 - alphas_cumprod)
        # "Large" fixed variance used when the variance is not learned: beta_t (posterior value at t=0).
        self.fixed_large_log_variance = torch.log(torch.cat([self.posterior_variance[1:2], betas[1:]]))

    # ----------------------------------------------------------------------------------------- forward
    def to(self, device) -> "GaussianDiffusion":
        """Keep the schedule on ``device`` (the model's): a step then indexes it without a host-to-device copy
        (a copy from pageable host memory makes the host wait for the GPU)."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        self.scheduler.alphas_cumprod = self.scheduler.alphas_cumprod.to(device)  # what add_noise indexes
        return self

    def model_timesteps(self, t: Tensor) -> Tensor:
        """The training timesteps the network is conditioned on for (possibly respaced) indices ``t``."""
        return self.timestep_map.to(t.device)[t]

    def q_sample(self, x_start: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """Sample ``x_t ~ q(x_t | x_0)``: ``sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise`` (diffusers' add_noise)."""
        return self.scheduler.add_noise(x_start, noise, self.model_timesteps(t))

    def q_posterior(self, x_start: Tensor, x_t: Tensor, t: Tensor):
        """Mean, variance and clipped log-variance of ``q(x_{t-1} | x_t, x_0)``."""
        mean = extract(self.posterior_mean_coef1, t, x_t) * x_start + extract(self.posterior_mean_coef2, t, x_t) * x_t
        return mean, extract(self.posterior_variance, t, x_t), extract(self.posterior_log_variance_clipped, t, x_t)

    def predict_xstart_from_eps(self, x_t: Tensor, t: Tensor, eps: Tensor) -> Tensor:
        return extract(self.sqrt_recip_alphas_cumprod, t, x_t) * x_t - extract(self.sqrt_recipm1_alphas_cumprod, t, x_t) * eps

    # ----------------------------------------------------------------------------------------- reverse
    def split_output(self, model_output: Tensor, x_t: Tensor):
        """(eps, variance values or None) from the network output; checks the channel count."""
        channels = x_t.shape[1]
        expected = 2 * channels if self.learn_sigma else channels
        if model_output.shape[1] != expected:
            raise ValueError(
                f"model output has {model_output.shape[1]} channels, expected {expected} for {channels}-channel "
                f"inputs with learn_sigma={self.learn_sigma}; build the model with the same learn_sigma"
            )
        if self.learn_sigma:
            return model_output[:, :channels], model_output[:, channels:]
        return model_output, None

    def p_mean_variance(self, model_output: Tensor, x_t: Tensor, t: Tensor, clip_denoised: bool = False) -> Dict[str, Tensor]:
        """Parameters of the reverse step ``p(x_{t-1} | x_t)`` from the network output at ``(x_t, t)``.

        Returns ``mean``, ``variance``, ``log_variance`` and ``pred_xstart`` (clamped to [-1, 1] when
        ``clip_denoised``; DiT samples latents unclipped).
        """
        eps, var_values = self.split_output(model_output, x_t)
        if var_values is None:
            log_variance = extract(self.fixed_large_log_variance, t, x_t).expand_as(x_t)
        else:
            min_log = extract(self.posterior_log_variance_clipped, t, x_t)
            max_log = extract(torch.log(self.betas), t, x_t)
            frac = (var_values + 1.0) / 2.0
            log_variance = frac * max_log + (1.0 - frac) * min_log
        pred_xstart = self.predict_xstart_from_eps(x_t, t, eps)
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1.0, 1.0)
        mean, _, _ = self.q_posterior(pred_xstart, x_t, t)
        return {"mean": mean, "variance": torch.exp(log_variance), "log_variance": log_variance, "pred_xstart": pred_xstart}

    def p_sample(
        self, model_output: Tensor, x_t: Tensor, t: Tensor, noise: Tensor, clip_denoised: bool = False
    ) -> Dict[str, Tensor]:
        """One ancestral step ``x_{t-1} = mean + exp(log_variance / 2) * noise`` (no noise at t=0).

        ``model_output`` is the network's output at ``(x_t, model_timesteps(t))`` (after any guidance);
        returns ``sample`` and ``pred_xstart``.
        """
        out = self.p_mean_variance(model_output, x_t, t, clip_denoised=clip_denoised)
        nonzero = (t != 0).to(x_t.dtype).reshape(-1, *([1] * (x_t.ndim - 1)))
        sample = out["mean"] + nonzero * torch.exp(0.5 * out["log_variance"]) * noise
        return {"sample": sample, "pred_xstart": out["pred_xstart"]}

    def ddim_sample(self, model_output: Tensor, x_t: Tensor, t: Tensor, noise: Tensor,
                    eta: float = 0.0) -> Dict[str, Tensor]:
        """One DDIM step (Song et al.; ADM's ``ddim_sample``) to the previous *respaced* step, with noise scale
        ``eta`` (0: deterministic); the variance channels are not used. Returns ``sample`` and ``pred_xstart``.

        Written here because diffusers' DDIMScheduler steps to ``t - T // n``, not to the previous respaced step.
        """
        eps, _ = self.split_output(model_output, x_t)
        pred_xstart = self.predict_xstart_from_eps(x_t, t, eps)
        abar, abar_prev = extract(self.alphas_cumprod, t, x_t), extract(self.alphas_cumprod_prev, t, x_t)
        sigma = eta * torch.sqrt((1 - abar_prev) / (1 - abar)) * torch.sqrt(1 - abar / abar_prev)
        mean = pred_xstart * torch.sqrt(abar_prev) + torch.sqrt(1 - abar_prev - sigma ** 2) * eps
        nonzero = (t != 0).to(x_t.dtype).reshape(-1, *([1] * (x_t.ndim - 1)))
        return {"sample": mean + nonzero * sigma * noise, "pred_xstart": pred_xstart}

    # ------------------------------------------------------------------------------------------ losses
    def vb_terms_bpd(self, model_output: Tensor, x_start: Tensor, x_t: Tensor, t: Tensor) -> Tensor:
        """Per-sample VLB term in bits per dimension: ``KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t))`` for
        t > 0, the discretised decoder NLL ``-log p(x_0 | x_1)`` at t = 0."""
        true_mean, _, true_log_variance = self.q_posterior(x_start, x_t, t)
        out = self.p_mean_variance(model_output, x_t, t)
        kl = mean_flat(normal_kl(true_mean, true_log_variance, out["mean"], out["log_variance"])) / LOG2
        nll = -discretized_gaussian_log_likelihood(x_start, out["mean"], 0.5 * out["log_variance"])
        nll = mean_flat(nll) / LOG2
        return torch.where(t == 0, nll, kl)

    def training_losses(
        self,
        model: Callable[..., Tensor],
        x_start: Tensor,
        t: Tensor,
        noise: Tensor,
        model_kwargs: Optional[dict] = None,
    ) -> Dict[str, Tensor]:
        """Per-sample ``loss = mse + vb`` (``vb = 0`` without learned sigma) for training indices ``t``.

        ``model(x_t, timesteps, **model_kwargs)`` is called once. The VLB sees the eps prediction
        detached, so it only trains the variance channels (the MSE trains the mean).
        """
        x_t = self.q_sample(x_start, t, noise)
        model_output, extra = model_and_extra(model(x_t, self.model_timesteps(t), **(model_kwargs or {})))
        eps, var_values = self.split_output(model_output.float(), x_t)
        mse = mean_flat((noise - eps) ** 2)
        if var_values is None:
            vb = torch.zeros_like(mse)
        else:
            frozen = torch.cat([eps.detach(), var_values], dim=1)
            vb = self.vb_terms_bpd(frozen, x_start, x_t, t)
        return {"loss": mse + vb, "mse": mse, "vb": vb, **({"extra": extra} if extra is not None else {})}

    # --------------------------------------------------------------- the objective protocol (diffusion.objective)
    time_draw = "index"  # a training example draws its timestep's index
    default_sampler = "ddpm"  # diffusion.sampling.chains.DDPMSampling

    def losses(self, model: Callable, x0: Tensor, draw: Tensor, noise: Tensor,
               model_kwargs: Optional[dict] = None) -> Dict[str, Tensor]:
        return self.training_losses(model, x0, draw, noise, model_kwargs)

    def description(self) -> Dict[str, object]:
        return {"objective": "ddpm", "num_timesteps": self.num_train_timesteps, "beta_start": self.beta_start,
                "beta_end": self.beta_end, "learn_sigma": self.learn_sigma, "respacing": self.respacing}
