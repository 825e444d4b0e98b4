"""Stochastic interpolants as SiT trains and samples them (Ma et al. 2024), every rule written out.

Time runs as in SiT: ``t = 0`` is noise ``x0 ~ N(0, I)``, ``t = 1`` is data ``x1``, and the network sees ``t`` in
[0, 1] through DiT's own timestep embedding. A *path* gives ``x_t = alpha_t x1 + sigma_t x0`` and its velocity
``u_t = alpha'_t x1 + sigma'_t x0``:

* ``linear``: ``alpha = t``, ``sigma = 1 - t`` (rectified flow);
* ``gvp``: ``alpha = sin(pi t / 2)``, ``sigma = cos(pi t / 2)`` (variance preserving at every t);
* ``vp``: the VP-SDE's ``alpha = exp(-(1-t)^2 (b1 - b0) / 4 - (1-t) b0 / 2)`` (b0 = 0.1, b1 = 20),
  ``sigma = sqrt(1 - alpha^2)``.

The network predicts the velocity ``u_t``, the noise ``x0`` or the score ``-x0 / sigma_t``; the loss is the MSE to
that target, for noise and score weighted by nothing, by ``(D_t / sigma_t)^2`` ("velocity") or ``D_t / sigma_t^2``
("likelihood"), with ``D_t = (alpha'_t / alpha_t) sigma_t^2 - sigma_t sigma'_t`` the drift variance. Training times
avoid the path's singular ends by ``train_eps`` and sampling times by ``sample_eps``, SiT's values by default.
``t`` is drawn uniformly (SiT) or logit-normally (``sigmoid(N(m, s))``, LightningDiT). LightningDiT also adds, to a
velocity model's MSE, ``w`` times its velocity-direction term ``1 - cos(pred, u_t)`` (cosine over the channels,
mean over the positions).

Sampling integrates from ``t = 0`` to 1. ODE: the velocity field (:meth:`Transport.velocity`), by fixed Euler or
Heun steps (written here) or an adaptive solver (``torchdiffeq``, as SiT). SDE: ``dx = [v + w_t s] dt +
sqrt(2 w_t) dW`` with the score ``s`` and a diffusion coefficient ``w_t`` (:data:`DIFFUSION_FORMS`), by
Euler-Maruyama or SiT's stochastic Heun steps, then one last step to ``t = 1`` (:data:`LAST_STEPS`). The step rules
are methods here, pure functions of tensors; the loops, noise and guidance are :mod:`diffusion.sampling`'s.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch

from common.cli import InputError
from diffusion.gaussian_diffusion import mean_flat
from diffusion.objective import model_and_extra

Tensor = torch.Tensor
PATHS = ("linear", "gvp", "vp")
PREDICTIONS = ("velocity", "noise", "score")
LOSS_WEIGHTS = ("none", "velocity", "likelihood")
TIME_DISTRIBUTIONS = ("uniform", "logit_normal")
DIFFUSION_FORMS = ("constant", "SBDM", "sigma", "linear", "decreasing", "increasing-decreasing")
LAST_STEPS = ("none", "mean", "tweedie", "euler")


def expand_like(t: Tensor, x: Tensor) -> Tensor:
    """``(B,)`` times shaped to broadcast against ``x (B, ...)``."""
    return t.reshape(t.shape[0], *([1] * (x.ndim - 1)))


# ------------------------------------------------------------------------------------------------- paths

class LinearPath:
    """``x_t = t x1 + (1 - t) x0``."""

    def alpha(self, t: Tensor) -> Tuple[Tensor, Tensor]:
        """``(alpha_t, alpha'_t)``, the data coefficient and its derivative."""
        return t, torch.ones_like(t)

    def sigma(self, t: Tensor) -> Tuple[Tensor, Tensor]:
        """``(sigma_t, sigma'_t)``, the noise coefficient and its derivative."""
        return 1 - t, -torch.ones_like(t)

    def alpha_ratio(self, t: Tensor) -> Tensor:
        """``alpha'_t / alpha_t``, in the form that is stable for the path."""
        return 1 / t

    def drift_variance(self, t: Tensor) -> Tensor:
        """``D_t = (alpha'_t / alpha_t) sigma_t^2 - sigma_t sigma'_t``: the velocity is ``(alpha'/alpha) x + D_t s``."""
        sigma, d_sigma = self.sigma(t)
        return self.alpha_ratio(t) * sigma ** 2 - sigma * d_sigma


class GVPPath(LinearPath):
    """``x_t = sin(pi t / 2) x1 + cos(pi t / 2) x0``."""

    def alpha(self, t):
        return torch.sin(t * math.pi / 2), math.pi / 2 * torch.cos(t * math.pi / 2)

    def sigma(self, t):
        return torch.cos(t * math.pi / 2), -math.pi / 2 * torch.sin(t * math.pi / 2)

    def alpha_ratio(self, t):
        return math.pi / (2 * torch.tan(t * math.pi / 2))


class VPPath(LinearPath):
    """The VP-SDE's path with ``beta(s)`` from ``beta_min`` to ``beta_max`` (in SiT's time, ``s = 1 - t``)."""

    def __init__(self, beta_min: float = 0.1, beta_max: float = 20.0):
        self.beta_min, self.beta_max = beta_min, beta_max

    def log_mean(self, t: Tensor) -> Tensor:
        return -0.25 * (1 - t) ** 2 * (self.beta_max - self.beta_min) - 0.5 * (1 - t) * self.beta_min

    def d_log_mean(self, t: Tensor) -> Tensor:
        return 0.5 * (1 - t) * (self.beta_max - self.beta_min) + 0.5 * self.beta_min

    def alpha(self, t):
        alpha = torch.exp(self.log_mean(t))
        return alpha, alpha * self.d_log_mean(t)

    def sigma(self, t):
        var_decay = torch.exp(2 * self.log_mean(t))
        sigma = torch.sqrt(1 - var_decay)
        return sigma, var_decay * (2 * self.d_log_mean(t)) / (-2 * sigma)

    def alpha_ratio(self, t):
        return self.d_log_mean(t)

    def drift_variance(self, t):
        """``beta(1 - t) / 2``, which the general formula equals."""
        return (self.beta_min + (1 - t) * (self.beta_max - self.beta_min)) / 2


PATH_CLASSES = {"linear": LinearPath, "gvp": GVPPath, "vp": VPPath}


def default_eps(path: str, prediction: str, train_eps: Optional[float], sample_eps: Optional[float]
                ) -> Tuple[float, float]:
    """SiT's ``(train_eps, sample_eps)``: VP 1e-5 / 1e-3; linear and GVP 1e-3 / 1e-3 for noise and score; 0 for
    velocity on linear and GVP, which is stable at both ends (SiT then ignores given values: here they are refused)."""
    if path == "vp":
        return (1e-5 if train_eps is None else train_eps), (1e-3 if sample_eps is None else sample_eps)
    if prediction != "velocity":
        return (1e-3 if train_eps is None else train_eps), (1e-3 if sample_eps is None else sample_eps)
    if train_eps or sample_eps:
        raise InputError(f"train_eps={train_eps}, sample_eps={sample_eps}: velocity on the {path} path is stable at "
                         "both ends and uses none (SiT's rule); leave them null or 0")
    return 0.0, 0.0


def times(x: Tensor, t: float) -> Tensor:
    """The time ``t`` for every sample of the batch ``x``: ``(B,)`` in ``x``'s dtype and device."""
    return torch.full((x.shape[0],), t, dtype=x.dtype, device=x.device)


def sde_step_size(grid: Tensor) -> float:
    """SiT's SDE step, the grid's first spacing in the grid's dtype, which every SDE step takes: a float32
    ``linspace`` is not evenly spaced to the last bit, and a step of ``t_next - t`` differs from SiT's by that."""
    return float(grid[1] - grid[0])


def shift_times(t: Tensor, shift: float) -> Tensor:
    """LightningDiT's timestep shift of a time grid, ``s t / (1 + (s - 1) t)`` (0 and 1 stay put); 0: no shift."""
    return t if shift <= 0 else shift * t / (1 + (shift - 1) * t)


class Transport:
    """SiT's transport: a path, what the network predicts, the loss weight and the times it trains and samples on.

    Args:
        path: ``linear``, ``gvp`` or ``vp``.
        prediction: ``velocity``, ``noise`` or ``score``.
        loss_weight: ``none``, ``velocity`` or ``likelihood`` (noise and score predictions; velocity has none).
        train_eps, sample_eps: distance kept from the singular ends; ``None``: SiT's (:func:`default_eps`).
        time_distribution: ``uniform`` (SiT) or ``logit_normal`` (LightningDiT) training times.
        logit_normal_mean, logit_normal_std: its ``m`` and ``s`` (LightningDiT: 0 and 1).
        cosine_loss_weight: the weight of LightningDiT's velocity-direction term (velocity prediction; its
            ``use_cosine_loss``: 1); 0: none.
    """

    def __init__(self, path: str = "linear", prediction: str = "velocity", loss_weight: str = "none",
                 train_eps: Optional[float] = None, sample_eps: Optional[float] = None,
                 time_distribution: str = "uniform", logit_normal_mean: float = 0.0, logit_normal_std: float = 1.0,
                 cosine_loss_weight: float = 0.0):
        for name, value, allowed in (("path", path, PATHS), ("prediction", prediction, PREDICTIONS),
                                     ("loss_weight", loss_weight, LOSS_WEIGHTS),
                                     ("time_distribution", time_distribution, TIME_DISTRIBUTIONS)):
            if value not in allowed:
                raise InputError(f"{name}={value!r}; choose one of {', '.join(allowed)}")
        if logit_normal_std <= 0:
            raise InputError(f"logit_normal_std={logit_normal_std} must be positive")
        if cosine_loss_weight < 0 or (cosine_loss_weight and prediction != "velocity"):
            raise InputError(f"cosine_loss_weight={cosine_loss_weight}: LightningDiT's cosine term compares predicted "
                             "and true velocities; give a weight >= 0, and > 0 only with prediction=velocity")
        self.path_name, self.prediction, self.loss_weight = path, prediction, loss_weight
        self.path = PATH_CLASSES[path]()
        self.train_eps, self.sample_eps = default_eps(path, prediction, train_eps, sample_eps)
        self.time_distribution = time_distribution
        self.logit_normal_mean, self.logit_normal_std = logit_normal_mean, logit_normal_std
        self.cosine_loss_weight = cosine_loss_weight

    def description(self) -> Dict[str, object]:
        """What a checkpoint records of its objective (the model's metadata; :meth:`from_description` reads it); the
        cosine term only when it is on."""
        described = {"path": self.path_name, "prediction": self.prediction, "loss_weight": self.loss_weight,
                     "train_eps": self.train_eps, "sample_eps": self.sample_eps,
                     "time_distribution": self.time_distribution, "logit_normal_mean": self.logit_normal_mean,
                     "logit_normal_std": self.logit_normal_std}
        return {**described, "cosine_loss_weight": self.cosine_loss_weight} if self.cosine_loss_weight else described

    @classmethod
    def from_description(cls, values: Dict[str, object]) -> "Transport":
        return cls(**values)

    # ---------------------------------------------------------------------------------------- times
    def interval(self, eps: float, sde: bool = False, diffusion_form: str = "SBDM",
                 last_step_size: float = 0.0) -> Tuple[float, float]:
        """SiT's ``[t0, t1]``: VP stops ``eps`` (or an SDE's last step) before the data; linear and GVP keep off
        both ends for noise and score predictions and for SDEs (the noise end only for SBDM diffusion or a
        non-velocity model); velocity ODEs and velocity training use all of [0, 1]."""
        t1_gap = eps if (not sde or last_step_size == 0) else last_step_size
        if self.path_name == "vp":
            return 0.0, 1 - t1_gap
        if self.prediction != "velocity" or sde:
            t0 = eps if (diffusion_form == "SBDM" and sde) or self.prediction != "velocity" else 0.0
            return t0, 1 - t1_gap
        return 0.0, 1.0

    def training_times(self, draw: Tensor) -> Tensor:
        """Training times in ``[t0, t1]`` from the example's draw: ``u ~ U[0, 1)`` (uniform) or ``n ~ N(0, 1)``
        (logit-normal, ``sigmoid(m + s n)``), so that every random choice stays in the dataset's seeded draws."""
        t0, t1 = self.interval(self.train_eps)
        if self.time_distribution == "logit_normal":
            draw = torch.sigmoid(self.logit_normal_mean + self.logit_normal_std * draw)
        return draw * (t1 - t0) + t0

    # ---------------------------------------------------------------------------------------- training
    def interpolate(self, t: Tensor, x0: Tensor, x1: Tensor) -> Tuple[Tensor, Tensor]:
        """``(x_t, u_t)``: the point on the path from noise ``x0`` to data ``x1`` and its velocity."""
        t = expand_like(t, x1)
        alpha, d_alpha = self.path.alpha(t)
        sigma, d_sigma = self.path.sigma(t)
        return alpha * x1 + sigma * x0, d_alpha * x1 + d_sigma * x0

    def loss_weights(self, t: Tensor, x: Tensor):
        """The per-sample weight of a noise or score loss (1 for ``none``)."""
        t = expand_like(t, x)
        sigma, _ = self.path.sigma(t)
        if self.loss_weight == "velocity":
            return (self.path.drift_variance(t) / sigma) ** 2
        if self.loss_weight == "likelihood":
            return self.path.drift_variance(t) / sigma ** 2
        return 1.0

    def training_losses(self, model: Callable[..., Tensor], x1: Tensor, t: Tensor, noise: Tensor,
                        model_kwargs: Optional[dict] = None) -> Dict[str, Tensor]:
        """Per-sample ``loss`` of data ``x1`` at times ``t`` (:meth:`training_times`) with noise ``x0``: the ``mse``
        plus, with ``cosine_loss_weight``, that weight times ``cos``, ``1 - cos(pred, u_t)`` over the channels,
        averaged over the positions (LightningDiT's ``cos_loss``).

        ``model(x_t, t, **model_kwargs)`` is called once; of a learned-sigma network's ``2C`` channels the first
        ``C`` are the prediction (SiT's checkpoints hold the other ``C`` unused). Also returns ``pred``.
        """
        x_t, u_t = self.interpolate(t, noise, x1)
        out, extra = model_and_extra(model(x_t, t, **(model_kwargs or {})))
        pred = out.float()[:, : x1.shape[1]]
        extra = {"extra": extra} if extra is not None else {}
        if self.prediction == "velocity":
            mse = mean_flat((pred - u_t) ** 2)
        else:
            weight = self.loss_weights(t, x_t)
            sigma, _ = self.path.sigma(expand_like(t, x_t))
            target_error = pred - noise if self.prediction == "noise" else pred * sigma + noise
            mse = mean_flat(weight * target_error ** 2)
        if not self.cosine_loss_weight:
            return {"loss": mse, "mse": mse, "pred": pred, **extra}
        cos = mean_flat(1 - torch.nn.functional.cosine_similarity(pred, u_t, dim=1))
        return {"loss": mse + self.cosine_loss_weight * cos, "mse": mse, "cos": cos, "pred": pred, **extra}

    # --------------------------------------------------------------- the objective protocol (diffusion.objective)
    @property
    def time_draw(self) -> str:
        """What a training example draws for its time (:meth:`training_times` maps it)."""
        return "normal" if self.time_distribution == "logit_normal" else "uniform"

    default_sampler = "sde-euler"  # SiT's FID sampler (diffusion.sampling.chains.FlowSampling)

    def losses(self, model: Callable, x0: Tensor, draw: Tensor, noise: Tensor,
               model_kwargs: Optional[dict] = None) -> Dict[str, Tensor]:
        return self.training_losses(model, x0, self.training_times(draw), noise, model_kwargs)

    def to(self, device) -> "Transport":
        """Nothing to move: the paths are closed forms."""
        return self

    # ---------------------------------------------------------------------------------------- fields
    def score(self, out: Tensor, x: Tensor, t: Tensor) -> Tensor:
        """``grad log p_t(x)`` from the network's prediction ``out`` at ``(x, t)``."""
        t = expand_like(t, x)
        if self.prediction == "score":
            return out
        if self.prediction == "noise":
            return out / -self.path.sigma(t)[0]
        alpha, d_alpha = self.path.alpha(t)
        sigma, d_sigma = self.path.sigma(t)
        ratio = alpha / d_alpha
        return (ratio * out - x) / (sigma ** 2 - ratio * d_sigma * sigma)

    def velocity(self, out: Tensor, x: Tensor, t: Tensor) -> Tensor:
        """The probability-flow velocity from the prediction: the prediction itself, or
        ``(alpha'/alpha) x + D_t score`` for noise and score predictions."""
        if self.prediction == "velocity":
            return out
        t_b = expand_like(t, x)
        return self.path.alpha_ratio(t_b) * x + self.path.drift_variance(t_b) * self.score(out, x, t)

    def diffusion_coefficient(self, t: Tensor, x: Tensor, form: str, norm: float) -> Tensor:
        """SiT's ``w_t`` of the SDE, :data:`DIFFUSION_FORMS`: ``norm`` times 1, ``D_t`` (SBDM), ``sigma_t`` or
        ``1 - t``; ``(norm cos(pi t) + 1)^2 / 4`` (decreasing); ``norm sin(pi t)^2`` (increasing-decreasing)."""
        t = expand_like(t, x)
        if form == "constant":
            return torch.full_like(t, norm)
        if form == "SBDM":
            return norm * self.path.drift_variance(t)
        if form == "sigma":
            return norm * self.path.sigma(t)[0]
        if form == "linear":
            return norm * (1 - t)
        if form == "decreasing":
            return 0.25 * (norm * torch.cos(math.pi * t) + 1) ** 2
        if form == "increasing-decreasing":
            return norm * torch.sin(math.pi * t) ** 2
        raise InputError(f"diffusion form {form!r}; choose one of {', '.join(DIFFUSION_FORMS)}")

    def sde_drift(self, out: Tensor, x: Tensor, t: Tensor, form: str, norm: float) -> Tensor:
        """``v + w_t s``: the drift of the SDE that keeps the path's marginals."""
        return self.velocity(out, x, t) + self.diffusion_coefficient(t, x, form, norm) * self.score(out, x, t)

    # ---------------------------------------------------------------------------------------- step rules
    # ``predict(x, t)`` is the network (with any guidance) at state ``x`` and time ``t``, a float the host knows (so
    # a guidance interval costs no device sync); ``times(x, t)`` is that time as the (B,) tensor the fields read.
    def euler_step(self, predict, x: Tensor, t: float, dt: float) -> Tensor:
        """ODE, Euler: ``x + dt v(x, t)``."""
        return x + dt * self.velocity(predict(x, t), x, times(x, t))

    def heun_step(self, predict, x: Tensor, t: float, dt: float) -> Tensor:
        """ODE, Heun (torchdiffeq's ``heun2``): ``k1 = v(x, t)``, ``k2 = v(x + dt k1, t + dt)``,
        ``x + dt (k1 + k2) / 2``."""
        k1 = self.velocity(predict(x, t), x, times(x, t))
        x_euler = x + dt * k1
        k2 = self.velocity(predict(x_euler, t + dt), x_euler, times(x, t + dt))
        return x + dt * 0.5 * (k1 + k2)

    # The SDE steps round as SiT's integrator: ``dt`` is :func:`sde_step_size`, the noise is scaled to ``dW`` first.
    def sde_noise(self, x: Tensor, tb: Tensor, dt: float, noise: Tensor, form: str, norm: float) -> Tensor:
        """``sqrt(2 w_t) dW`` with ``dW = sqrt(dt) noise``."""
        return torch.sqrt(2 * self.diffusion_coefficient(tb, x, form, norm)) * (noise * math.sqrt(dt))

    def sde_euler_step(self, predict, x: Tensor, t: float, dt: float, noise: Tensor, form: str,
                       norm: float) -> Tensor:
        """SDE, Euler-Maruyama: ``x + dt (v + w s) + sqrt(2 w dt) noise``."""
        tb = times(x, t)
        drift = self.sde_drift(predict(x, t), x, tb, form, norm)
        return x + drift * dt + self.sde_noise(x, tb, dt, noise, form, norm)

    def sde_heun_step(self, predict, x: Tensor, t: float, dt: float, noise: Tensor, form: str,
                      norm: float) -> Tensor:
        """SDE, SiT's Heun: the noise first, ``x^ = x + sqrt(2 w_t dt) noise``, then a Heun step of the drift from
        ``x^``: ``k1 = f(x^, t)``, ``k2 = f(x^ + dt k1, t + dt)``, ``x^ + dt (k1 + k2) / 2``."""
        tb, tb_next = times(x, t), times(x, t + dt)
        x_hat = x + self.sde_noise(x, tb, dt, noise, form, norm)
        k1 = self.sde_drift(predict(x_hat, t), x_hat, tb, form, norm)
        x_euler = x_hat + dt * k1
        k2 = self.sde_drift(predict(x_euler, t + dt), x_euler, tb_next, form, norm)
        return x_hat + 0.5 * dt * (k1 + k2)

    def last_step(self, predict, x: Tensor, t: float, size: float, kind: str, form: str, norm: float) -> Tensor:
        """SiT's last SDE step from ``t1`` to the data (:data:`LAST_STEPS`): ``none`` keeps ``x``; ``mean`` is
        an Euler step of the SDE drift without noise; ``euler`` one of the ODE velocity; ``tweedie`` is Tweedie's
        denoiser ``x / alpha + sigma^2 / alpha * score``."""
        if kind == "none":
            return x
        out, tb = predict(x, t), times(x, t)
        if kind == "mean":
            return x + self.sde_drift(out, x, tb, form, norm) * size
        if kind == "euler":
            return x + self.velocity(out, x, tb) * size
        if kind == "tweedie":
            t_b = expand_like(tb, x)
            alpha, sigma = self.path.alpha(t_b)[0], self.path.sigma(t_b)[0]
            return x / alpha + sigma ** 2 / alpha * self.score(out, x, tb)
        raise InputError(f"last step {kind!r}; choose one of {', '.join(LAST_STEPS)}")


def transport_from_config(section: Dict[str, object]) -> Transport:
    """The :class:`Transport` of a training config's ``transport:`` section (as a dict)."""
    values = {k: v for k, v in section.items() if k != "enabled" and v is not None}
    return Transport(**values)
