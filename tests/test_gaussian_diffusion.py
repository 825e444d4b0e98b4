"""Gaussian diffusion against direct formulas computed independently in float64 (numpy/scipy)."""
import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from diffusion.gaussian_diffusion import (
    DIT_SCHEDULE,
    GaussianDiffusion,
    discretized_gaussian_log_likelihood,
    normal_kl,
    respaced_timesteps,
)

T = 1000


def dit_diffusion(learn_sigma=True, **options):
    """DiT's diffusion: its schedule (1000 linear steps, 1e-4..0.02), learned sigma unless told otherwise."""
    return GaussianDiffusion(**DIT_SCHEDULE, learn_sigma=learn_sigma, **options)


def np_schedule():
    betas = np.linspace(1e-4, 0.02, T, dtype=np.float64)
    return betas, np.cumprod(1.0 - betas)


def fixed_tensors(seed=0, shape=(4, 2, 3, 3)):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1
    noise = torch.randn(shape, generator=g, dtype=torch.float64)
    return x0, noise


def test_schedule_is_linear_1000_steps():
    d = dit_diffusion()
    betas, abar = np_schedule()
    assert d.num_timesteps == T
    np.testing.assert_allclose(d.betas.numpy(), betas, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(d.alphas_cumprod.numpy(), abar, rtol=2e-5)


def test_q_sample_matches_direct_formula():
    d = dit_diffusion()
    _, abar = np_schedule()
    x0, noise = fixed_tensors()
    t = torch.tensor([0, 10, 500, 999])
    got = d.q_sample(x0.float(), t, noise.float()).double().numpy()
    a = abar[t.numpy()].reshape(-1, 1, 1, 1)
    want = np.sqrt(a) * x0.numpy() + np.sqrt(1 - a) * noise.numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)  # diffusers' add_noise works in float32


def test_posterior_matches_bayes_rule():
    """q(x_{t-1}|x_t,x_0) ∝ N(x_{t-1}; sqrt(abar_{t-1}) x0, 1-abar_{t-1}) · N(x_t; sqrt(alpha_t) x_{t-1}, beta_t)."""
    d = dit_diffusion()
    betas, abar = np_schedule()
    x0, xt = fixed_tensors(1)
    t = torch.tensor([1, 2, 300, 999])
    mean, var, logvar = d.q_posterior(x0, xt, t)
    tn = t.numpy()
    prior_var = (1 - abar[tn - 1]).reshape(-1, 1, 1, 1)
    alpha, beta = (1 - betas[tn]).reshape(-1, 1, 1, 1), betas[tn].reshape(-1, 1, 1, 1)
    post_var = 1.0 / (1.0 / prior_var + alpha / beta)
    post_mean = post_var * (np.sqrt(abar[tn - 1]).reshape(-1, 1, 1, 1) * x0.numpy() / prior_var + np.sqrt(alpha) * xt.numpy() / beta)
    np.testing.assert_allclose(mean.numpy(), post_mean, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(var.numpy().ravel(), post_var.ravel(), rtol=1e-4)
    np.testing.assert_allclose(logvar.numpy().ravel(), np.log(post_var).ravel(), atol=1e-4)
    # At t=0 the posterior collapses onto x_0; its log-variance is clipped to the t=1 value.
    mean0, var0, logvar0 = d.q_posterior(x0, xt, torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(mean0, x0, atol=1e-6, rtol=0)
    assert torch.all(var0 == 0)
    torch.testing.assert_close(logvar0, d.posterior_log_variance_clipped[1].expand_as(logvar0))


def test_normal_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(2)
    m1, m2 = torch.randn(2, 50, generator=g, dtype=torch.float64)
    lv1, lv2 = torch.randn(2, 50, generator=g, dtype=torch.float64)
    want = torch.distributions.kl_divergence(
        torch.distributions.Normal(m1, torch.exp(0.5 * lv1)), torch.distributions.Normal(m2, torch.exp(0.5 * lv2))
    )
    torch.testing.assert_close(normal_kl(m1, lv1, m2, lv2), want)


def test_discretized_gaussian_log_likelihood_closed_form_and_normalised():
    x = torch.tensor([-1.0, -0.5, 0.0, 0.25, 1.0], dtype=torch.float64)
    mean = torch.tensor([0.1, -0.4, 0.9, 0.2, 0.8], dtype=torch.float64)
    log_scale = torch.tensor([-1.0, -3.0, 0.0, -6.0, -2.0], dtype=torch.float64)
    h = 1.0 / 255.0
    s = np.exp(log_scale.numpy())
    xn, mn = x.numpy(), mean.numpy()
    want = np.log(np.maximum(norm.cdf((xn - mn + h) / s) - norm.cdf((xn - mn - h) / s), 1e-12))
    want[0] = np.log(norm.cdf((xn[0] - mn[0] + h) / s[0]))
    want[-1] = np.log(norm.sf((xn[-1] - mn[-1] - h) / s[-1]))
    got = discretized_gaussian_log_likelihood(x, mean, log_scale).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # The 256 bins of [-1, 1] carry all the mass.
    bins = torch.linspace(-1, 1, 256, dtype=torch.float64)
    total = discretized_gaussian_log_likelihood(bins, torch.full_like(bins, 0.3), torch.full_like(bins, -1.5)).exp().sum()
    assert abs(total.item() - 1.0) < 1e-9


def test_vb_terms_match_closed_form():
    """Learned-range variance, KL at t>0 and decoder NLL at t=0, in bits/dim, from scipy/numpy."""
    d = dit_diffusion(learn_sigma=True)
    betas, abar = np_schedule()
    x0, noise = fixed_tensors(3)
    g = torch.Generator().manual_seed(4)
    eps = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    v = torch.rand(x0.shape, generator=g, dtype=torch.float64) * 2 - 1
    t = torch.tensor([0, 1, 250, 999])
    xt = d.q_sample(x0, t, noise)
    got = d.vb_terms_bpd(torch.cat([eps, v], 1), x0, xt, t).numpy()

    tn = t.numpy()
    r = lambda a: a.reshape(-1, 1, 1, 1)  # noqa: E731
    ab, ab_prev = r(abar[tn]), r(np.where(tn > 0, abar[tn - 1], 1.0))
    beta = r(betas[tn])
    post_var = beta * (1 - ab_prev) / (1 - ab)
    post_var_t1 = betas[1] * (1 - abar[0]) / (1 - abar[1])
    min_log = np.log(np.where(r(tn) == 0, post_var_t1, post_var))
    logvar = (v.numpy() + 1) / 2 * np.log(beta) + (1 - (v.numpy() + 1) / 2) * min_log
    xtn, x0n = xt.numpy(), x0.numpy()
    c1 = np.sqrt(ab_prev) * beta / (1 - ab)
    c2 = np.sqrt(1 - beta) * (1 - ab_prev) / (1 - ab)
    true_mean = c1 * x0n + c2 * xtn
    pred_x0 = (xtn - np.sqrt(1 - ab) * eps.numpy()) / np.sqrt(ab)
    model_mean = c1 * pred_x0 + c2 * xtn
    kl = 0.5 * (logvar - min_log + np.exp(min_log - logvar) + (true_mean - model_mean) ** 2 / np.exp(logvar) - 1)
    sd = np.exp(0.5 * logvar)
    h = 1 / 255
    cdf_hi, cdf_lo = norm.cdf((x0n - model_mean + h) / sd), norm.cdf((x0n - model_mean - h) / sd)
    p = np.where(x0n < -0.999, cdf_hi, np.where(x0n > 0.999, 1 - cdf_lo, cdf_hi - cdf_lo))
    nll = -np.log(np.maximum(p, 1e-12))
    per_dim = np.where(r(tn) == 0, nll, kl)
    want = per_dim.reshape(4, -1).mean(1) / math.log(2)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_training_losses_stop_gradient_and_plain_mse():
    torch.manual_seed(0)
    x0, noise = (a.float() for a in fixed_tensors(5))
    t = torch.tensor([0, 3, 400, 999])
    d = dit_diffusion(learn_sigma=True)
    out = torch.randn(4, 4, 3, 3, requires_grad=True)
    losses = d.training_losses(lambda x, ts: out, x0, t, noise)
    torch.testing.assert_close(losses["mse"], ((noise - out[:, :2]) ** 2).mean((1, 2, 3)))
    torch.testing.assert_close(losses["loss"], losses["mse"] + losses["vb"])
    (g_vb,) = torch.autograd.grad(losses["vb"].sum(), out, retain_graph=True)
    assert torch.all(g_vb[:, :2] == 0), "the VLB must not train the mean"
    assert g_vb[:, 2:].abs().sum() > 0
    (g_mse,) = torch.autograd.grad(losses["mse"].sum(), out)
    assert torch.all(g_mse[:, 2:] == 0)

    plain = dit_diffusion(learn_sigma=False)
    seen = {}

    def model(x, ts):
        seen["t"] = ts
        return out[:, :2]

    losses = plain.training_losses(model, x0, t, noise)
    torch.testing.assert_close(losses["loss"], ((noise - out[:, :2]) ** 2).mean((1, 2, 3)))
    assert torch.all(losses["vb"] == 0)
    assert torch.equal(seen["t"], t)
    with pytest.raises(ValueError, match="learn_sigma"):
        d.training_losses(model, x0, t, noise)


def test_respacing_matches_adm_spacing_and_original_chain():
    d = dit_diffusion(sampling_steps=250)
    stride, kept, cur = 999 / 249, [], 0.0
    for _ in range(250):
        kept.append(round(cur))
        cur += stride
    assert d.timestep_map.tolist() == kept
    full = dit_diffusion()
    torch.testing.assert_close(d.alphas_cumprod, full.alphas_cumprod[d.timestep_map])
    # q_sample at respaced index i is q_sample at training step timestep_map[i].
    x0, noise = (a.float() for a in fixed_tensors(6))
    i = torch.tensor([0, 1, 100, 249])
    torch.testing.assert_close(d.q_sample(x0, i, noise), full.q_sample(x0, d.timestep_map[i], noise))
    # Respacing to all steps changes nothing.
    same = dit_diffusion(sampling_steps=T)
    torch.testing.assert_close(same.posterior_mean_coef1, full.posterior_mean_coef1)


def adm_space_timesteps(num_timesteps, section_counts):
    """ADM's ``space_timesteps`` (guided-diffusion respace.py), re-stated: the set of kept training steps, or
    ValueError where ADM raises."""
    if isinstance(section_counts, str) and section_counts.startswith("ddim"):
        desired = int(section_counts[len("ddim"):])
        for stride in range(1, num_timesteps):
            if len(range(0, num_timesteps, stride)) == desired:
                return set(range(0, num_timesteps, stride))
        raise ValueError("no integer stride")
    counts = [int(x) for x in str(section_counts).split(",")]
    size_per, extra = num_timesteps // len(counts), num_timesteps % len(counts)
    start, steps = 0, []
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        if size < count:
            raise ValueError("section too small")
        frac_stride = 1 if count <= 1 else (size - 1) / (count - 1)
        cur = 0.0
        for _ in range(count):
            steps.append(start + round(cur))
            cur += frac_stride
        start += size
    return set(steps)


def test_respacing_rules_equal_adm_space_timesteps_for_every_count():
    """Both conventions, every count 1..T for T = 1000 (and other lengths), and section strings, against the
    re-statement above; counts with no integer stride are refused where ADM refuses them."""
    refused = []
    for num in (1000, 300, 4000 // 7):
        for n in range(1, num + 1):
            assert respaced_timesteps(num, n) == sorted(adm_space_timesteps(num, str(n))), (num, n)
            try:
                expected = sorted(adm_space_timesteps(num, f"ddim{n}"))
            except ValueError:
                with pytest.raises(ValueError, match="no integer stride"):
                    respaced_timesteps(num, f"ddim{n}")
                refused.append((num, n))
                continue
            assert respaced_timesteps(num, f"ddim{n}") == expected, (num, n)
    assert (1000, 300) in refused and (1000, 1) in refused and (1000, 50) not in refused
    assert sum(1 for num, _ in refused if num == 1000) == 938  # only 62 counts have an integer stride over 1000
    for sections in ("10,15,20", "1,1,1", "0,5", "3,0,2,7", "250,250,250,250", "500,1", "1,400", "334,333,333"):
        assert respaced_timesteps(1000, sections) == sorted(adm_space_timesteps(1000, sections)), sections
    with pytest.raises(ValueError):
        adm_space_timesteps(1000, "600,600")  # two sections of 500 steps cannot hold 600 each
    with pytest.raises(ValueError, match="a section of 500 training steps cannot hold 600"):
        respaced_timesteps(1000, "600,600")
    assert respaced_timesteps(1000, "ddim50") == list(range(0, 1000, 20))
    assert respaced_timesteps(1000, 50)[:4] == [0, 20, 41, 61] and respaced_timesteps(1000, 50)[-1] == 999


def test_sampling_steps_and_spacing_select_the_rule():
    even = dit_diffusion(sampling_steps=50)
    ddim = dit_diffusion(sampling_steps=50, spacing="ddim")
    assert (even.respacing, ddim.respacing) == ("50", "ddim50")
    assert ddim.timestep_map.tolist() == list(range(0, 1000, 20)) and ddim.num_timesteps == 50
    assert even.timestep_map.tolist() == sorted(adm_space_timesteps(1000, "50"))
    # the DDPM default is unchanged: 250 steps as round(linspace(0, 999, 250)) gave them before
    assert dit_diffusion(sampling_steps=250).timestep_map.tolist() == \
        np.round(np.linspace(0, 999, 250)).astype(int).tolist()
    sections = dit_diffusion(sampling_steps="10,15,20")
    assert sections.timestep_map.tolist() == sorted(adm_space_timesteps(1000, "10,15,20"))
    assert sections.num_timesteps == 45 and dit_diffusion(sampling_steps="ddim25").respacing == "ddim25"
    # the respaced chain keeps abar at the kept steps, so betas telescope back to the training schedule's
    full = dit_diffusion()
    torch.testing.assert_close(ddim.alphas_cumprod, full.alphas_cumprod[ddim.timestep_map])
    torch.testing.assert_close(torch.cumprod(1 - ddim.betas, 0), ddim.alphas_cumprod)
    assert dit_diffusion(sampling_steps=T, spacing="ddim").timestep_map.tolist() == list(range(T))
    with pytest.raises(ValueError, match="use 250 or 334 steps"):
        dit_diffusion(sampling_steps=300, spacing="ddim")
    with pytest.raises(ValueError, match="choose one of even, ddim"):
        dit_diffusion(sampling_steps=50, spacing="linspace")
    with pytest.raises(ValueError, match=r"must lie in \[1, 1000\]"):
        dit_diffusion(sampling_steps=0)
    with pytest.raises(ValueError, match="ddim must be followed|'ddim' must be followed"):
        dit_diffusion(sampling_steps="ddimx")


def test_p_sample_with_true_noise_recovers_posterior():
    """If the network predicts the true noise and v=-1, the reverse step is the true posterior."""
    d = dit_diffusion(sampling_steps=50)
    x0, noise = fixed_tensors(7)
    step_noise = fixed_tensors(8)[1]
    t = torch.tensor([0, 1, 25, 49])
    xt = d.q_sample(x0, t, noise)
    out = torch.cat([noise, -torch.ones_like(noise)], 1)
    res = d.p_sample(out, xt, t, step_noise)
    mean, _, logvar = d.q_posterior(x0, xt, t)
    torch.testing.assert_close(res["pred_xstart"], x0, atol=1e-5, rtol=0)
    want = mean + (t > 0).double().reshape(-1, 1, 1, 1) * torch.exp(0.5 * logvar) * step_noise
    torch.testing.assert_close(res["sample"], want, atol=1e-5, rtol=0)
    no_noise = d.p_mean_variance(out, xt, t)["mean"]
    assert torch.equal(res["sample"][0], no_noise[0]), "no noise is added at the last step"


@pytest.mark.parametrize("learn_sigma", [False, True])
def test_ancestral_chain_with_exact_denoiser_reproduces_gaussian_data(learn_sigma):
    """For data N(0, s^2) the exact denoiser is linear, E[eps | x_t] = sqrt(1-abar) x_t / (abar s^2 + 1 - abar);
    ancestral sampling with it (respaced to 250 steps; variance beta_t, or the posterior's via v=-1) must
    give back std ~= s (a wrong timestep map gives ~1.9 s)."""
    s = 0.5
    d = dit_diffusion(learn_sigma=learn_sigma, sampling_steps=250)
    abar_train = dit_diffusion().alphas_cumprod.float()

    def exact_eps(x, model_t):
        a = abar_train[model_t].reshape(-1, 1)
        eps = torch.sqrt(1 - a) * x / (a * s * s + 1 - a)
        return torch.cat([eps, -torch.ones_like(eps)], 1) if learn_sigma else eps

    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 40, generator=g)  # 20000 iid values
    for i in reversed(range(d.num_timesteps)):
        t = torch.full((len(x),), i)
        x = d.p_sample(exact_eps(x, d.model_timesteps(t)), x, t, torch.randn(x.shape, generator=g))["sample"]
    assert abs(x.std().item() - s) < 0.04 * s
    assert abs(x.mean().item()) < 0.02
