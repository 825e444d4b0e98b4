"""An independent re-statement of SiT's ``transport`` package (willisma/SiT) and REPA's projector and loss
(sihyun-yu/REPA ``models/sit.py``, ``loss.py``) for the tests, written from their equations.

It follows the structure of the public code, not of ``diffusion.transport``: coupling plans with SiT's
``compute_alpha_t``/``compute_sigma_t``/``compute_drift`` (SiT's own VP drift), ``create_transport``'s eps rules,
``check_interval``, the weighted losses, the drift and score of each prediction (the model is called once per
quantity, as in SiT), the SDE integrator with its last steps, and the ODE through ``torchdiffeq.odeint`` on SiT's
``linspace(t0, t1, num_steps)``. Randomness is passed in (``t``, ``x0``, the SDE's noise) so both sides see the same
numbers. Nothing here imports the project's code.
"""
import math

import torch
from torchdiffeq import odeint


def _col(t, x):
    return t.view(t.shape[0], *([1] * (x.dim() - 1)))


class Linear:
    def alpha(self, t):
        return t, 1

    def sigma(self, t):
        return 1 - t, -1

    def d_alpha_over_alpha(self, t):
        return 1 / t

    def drift(self, x, t):
        t = _col(t, x)
        ratio = self.d_alpha_over_alpha(t)
        s, ds = self.sigma(t)
        return -(ratio * x), ratio * s ** 2 - s * ds


class GVP(Linear):
    def alpha(self, t):
        return torch.sin(t * math.pi / 2), math.pi / 2 * torch.cos(t * math.pi / 2)

    def sigma(self, t):
        return torch.cos(t * math.pi / 2), -math.pi / 2 * torch.sin(t * math.pi / 2)

    def d_alpha_over_alpha(self, t):
        return math.pi / (2 * torch.tan(t * math.pi / 2))


class VP(Linear):
    smin, smax = 0.1, 20.0

    def lmc(self, t):
        return -0.25 * (1 - t) ** 2 * (self.smax - self.smin) - 0.5 * (1 - t) * self.smin

    def dlmc(self, t):
        return 0.5 * (1 - t) * (self.smax - self.smin) + 0.5 * self.smin

    def alpha(self, t):
        a = torch.exp(self.lmc(t))
        return a, a * self.dlmc(t)

    def sigma(self, t):
        e = torch.exp(2 * self.lmc(t))
        s = torch.sqrt(1 - e)
        return s, e * (2 * self.dlmc(t)) / (-2 * s)

    def d_alpha_over_alpha(self, t):
        return self.dlmc(t)

    def drift(self, x, t):
        t = _col(t, x)
        beta = self.smin + (1 - t) * (self.smax - self.smin)
        return -0.5 * beta * x, beta / 2


PLANS = {"linear": Linear, "gvp": GVP, "vp": VP}


class SiTTransport:
    def __init__(self, path, prediction, loss_weight=None, train_eps=None, sample_eps=None):
        self.plan = PLANS[path]()
        self.path, self.prediction, self.weight = path, prediction, loss_weight
        if path == "vp":
            self.train_eps = 1e-5 if train_eps is None else train_eps
            self.sample_eps = 1e-3 if sample_eps is None else sample_eps
        elif prediction != "velocity":
            self.train_eps = 1e-3 if train_eps is None else train_eps
            self.sample_eps = 1e-3 if sample_eps is None else sample_eps
        else:
            self.train_eps = self.sample_eps = 0

    def check_interval(self, sde=False, evaluate=False, form="SBDM", last=0.0):
        eps = self.sample_eps if evaluate else self.train_eps
        t0, t1 = 0, 1
        if self.path == "vp":
            t1 = 1 - eps if (not sde or last == 0) else 1 - last
        elif self.prediction != "velocity" or sde:
            t0 = eps if (form == "SBDM" and sde) or self.prediction != "velocity" else 0
            t1 = 1 - eps if (not sde or last == 0) else 1 - last
        return t0, t1

    def loss(self, model, x1, t, x0):
        tc = _col(t, x1)
        a, da = self.plan.alpha(tc)
        s, ds = self.plan.sigma(tc)
        xt, ut = a * x1 + s * x0, da * x1 + ds * x0
        out = model(xt, t)
        dims = list(range(1, x1.dim()))
        if self.prediction == "velocity":
            return ((out - ut) ** 2).mean(dims)
        _, var = self.plan.drift(xt, t)
        w = {"velocity": (var / s) ** 2, "likelihood": var / s ** 2}.get(self.weight, 1)
        if self.prediction == "noise":
            return (w * (out - x0) ** 2).mean(dims)
        return (w * (out * s + x0) ** 2).mean(dims)

    def drift(self, x, t, model):
        if self.prediction == "velocity":
            return model(x, t)
        mean, var = self.plan.drift(x, t)
        out = model(x, t)
        score = out if self.prediction == "score" else out / -self.plan.sigma(_col(t, x))[0]
        return -mean + var * score

    def score(self, x, t, model):
        if self.prediction == "noise":
            return model(x, t) / -self.plan.sigma(_col(t, x))[0]
        if self.prediction == "score":
            return model(x, t)
        tc = _col(t, x)
        a, da = self.plan.alpha(tc)
        s, ds = self.plan.sigma(tc)
        r = a / da
        return (r * model(x, t) - x) / (s ** 2 - r * ds * s)

    def diffusion(self, x, t, form, norm):
        t = _col(t, x)
        # SiT returns the bare number for "constant", which its integrator's th.sqrt refuses; a tensor here.
        return {"constant": lambda: torch.as_tensor(norm), "SBDM": lambda: norm * self.plan.drift(x, t)[1],
                "sigma": lambda: norm * self.plan.sigma(t)[0], "linear": lambda: norm * (1 - t),
                "decreasing": lambda: 0.25 * (norm * torch.cos(math.pi * t) + 1) ** 2,
                "increasing-decreasing": lambda: norm * torch.sin(math.pi * t) ** 2}[form]()

    def sample_sde(self, x, model, noises, method="Euler", form="sigma", norm=1.0, last="Mean", last_size=0.04,
                   num_steps=10):
        """SiT's Sampler.sample_sde then its integrator, with ``noises`` in place of ``randn``, in its rounding: every
        step takes the grid's first spacing ``dt`` (float32), and the noise is scaled to ``dW = sqrt(dt) w`` first."""
        if last is None:
            last_size = 0.0
        t0, t1 = self.check_interval(sde=True, evaluate=True, form=form, last=last_size)
        grid = torch.linspace(t0, t1, num_steps)
        dt = grid[1] - grid[0]

        def sde_drift(x, t):
            return self.drift(x, t, model) + self.diffusion(x, t, form, norm) * self.score(x, t, model)

        for ti in grid[:-1]:
            w = next(noises)
            tt = torch.ones(x.shape[0]) * ti
            dw = w * torch.sqrt(dt)
            if method == "Euler":
                mean = x + sde_drift(x, tt) * dt
                x = mean + torch.sqrt(2 * self.diffusion(x, tt, form, norm)) * dw
            else:
                xhat = x + torch.sqrt(2 * self.diffusion(x, tt, form, norm)) * dw
                k1 = sde_drift(xhat, tt)
                k2 = sde_drift(xhat + dt * k1, tt + dt)
                x = xhat + 0.5 * dt * (k1 + k2)
        tt = torch.ones(x.shape[0]) * t1
        if last == "Mean":
            return x + sde_drift(x, tt) * last_size
        if last == "Euler":
            return x + self.drift(x, tt, model) * last_size
        if last == "Tweedie":
            a = self.plan.alpha(tt)[0][0]
            s = self.plan.sigma(tt)[0][0]
            return x / a + s ** 2 / a * self.score(x, tt, model)
        return x

    def sample_ode(self, x, model, method="euler", num_steps=10, atol=1e-6, rtol=1e-3, shift=0.0):
        """SiT's Sampler.sample_ode (LightningDiT's shift of the grid when ``shift`` > 0): torchdiffeq on the grid."""
        t0, t1 = self.check_interval(sde=False, evaluate=True)
        grid = torch.linspace(t0, t1, num_steps)
        if shift > 0:
            grid = torch.tensor([shift * t / (1 + (shift - 1) * t) for t in grid])
        states = odeint(lambda t, y: self.drift(y, torch.ones(y.shape[0]) * t, model), x, grid, method=method,
                        atol=[atol], rtol=[rtol])
        return states[-1]


def repa_projector_forward(weights, h):
    """REPA's ``build_mlp``: Linear, SiLU, Linear, SiLU, Linear, applied to ``(N*T, D)`` rows."""
    n, t, d = h.shape
    x = h.reshape(-1, d)
    for i in (0, 2):
        x = torch.nn.functional.silu(x @ weights[f"{i}.weight"].t() + weights[f"{i}.bias"])
    x = x @ weights["4.weight"].t() + weights["4.bias"]
    return x.reshape(n, t, -1)


def repa_projection_loss(zs, zs_tilde):
    """REPA's SILoss projection term: ``-cos`` per token, mean over tokens, summed over the batch and the encoders,
    divided by ``encoders * batch``."""
    loss = 0.0
    bsz = zs[0].shape[0]
    for z, z_tilde in zip(zs, zs_tilde):
        for z_j, z_tilde_j in zip(z, z_tilde):
            z_j = torch.nn.functional.normalize(z_j, dim=-1)
            z_tilde_j = torch.nn.functional.normalize(z_tilde_j, dim=-1)
            loss = loss + (-(z_j * z_tilde_j).sum(dim=-1)).mean()
    return loss / (len(zs) * bsz)
