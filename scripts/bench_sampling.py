"""Host time of the sampler's noise, the way it was drawn before and the way diffusion.sampling draws it now.

    python -m scripts.bench_sampling                    # DiT-XL/2 latents (4x32x32), batch 64, 250 steps
    python -m scripts.bench_sampling --shape 1,32,32    # the Fashion-MNIST pixel DiT

Prints, side by side and as ratios (same numbers either way; tests/test_sample.py checks them bit for bit):

* seeds: a noise stream per sample, ``np.random.SeedSequence([seed, i])`` per sample vs :func:`sample_seeds` over the
  whole chunk (then one ``torch.Generator`` per sample either way);
* noise: one draw per sample and step, stacked and moved to the device (a pageable copy, which makes the host wait on
  a GPU) vs :func:`chain_noise` (a window of steps per sample and torch call, drawn by a worker thread, through
  pinned memory on CUDA): the host's own cost per chunk, without a model;
* chain: the whole reverse chain of the Fashion-MNIST micro-DiT (``--chain-steps``), noise drawn before each step
  vs drawn ahead while the model runs.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from diffusion.spec import DiTSpec
from diffusion.sampling import chain_noise, draw_noise, sample_generators, sample_loop, sample_seeds


def best_of(fn, repeat: int) -> float:
    """Fastest wall time of ``repeat`` calls (seconds)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def per_sample_seeds(seed: int, indices) -> list:
    return [torch.Generator().manual_seed(int(np.random.SeedSequence([seed, int(i)]).generate_state(1)[0]))
            for i in indices]


def per_step_noise(generators, shape, draws, device) -> None:
    for _ in range(draws):
        draw_noise(generators, shape).to(device)


def window_noise(generators, shape, draws, device) -> None:
    for _ in chain_noise(generators, shape, draws, device):
        pass
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def chain(model, diffusion, generators, shape, device, ahead: bool):
    """The reverse DDPM chain, the noise drawn ahead (:func:`reverse_chain`) or before each step (as it was)."""
    labels = torch.arange(len(generators), device=device) % model.num_classes
    fn = lambda x, t: model(x, t, labels)  # noqa: E731
    if ahead:
        return sample_loop(fn, diffusion, generators, shape, device=device)
    x = draw_noise(generators, shape).to(device)
    for i in reversed(range(diffusion.num_timesteps)):
        t = torch.full((len(x),), i, device=device, dtype=torch.long)
        out = fn(x, diffusion.model_timesteps(t))
        x = diffusion.p_sample(out, x, t, draw_noise(generators, shape).to(device))["sample"]
    return x


def run(batch: int, shape, steps: int, device: str, repeat: int, chain_steps: int) -> dict:
    indices = range(batch)
    seeds_before = best_of(lambda: per_sample_seeds(0, indices), repeat)
    seeds_after = best_of(lambda: sample_generators(0, indices), repeat)
    assert [g.initial_seed() for g in per_sample_seeds(0, indices)] == sample_seeds(0, indices).tolist()
    draws = steps + 1  # x_T and one draw per step
    noise_before = best_of(lambda: per_step_noise(sample_generators(0, indices), shape, draws, device), repeat)
    noise_after = best_of(lambda: window_noise(sample_generators(0, indices), shape, draws, device), repeat)
    spec = DiTSpec.published("DiT-S/4", in_channels=shape[0], input_size=shape[1], num_classes=10, autoencoder="none",
                             kwargs={"hidden_size": 96, "depth": 4, "num_heads": 3})
    model, diffusion = spec.build().to(device).eval(), spec.diffusion(sampling_steps=chain_steps).to(device)
    with torch.no_grad():
        before, after = (chain(model, diffusion, sample_generators(0, indices), shape, device, ahead)
                         for ahead in (False, True))
        assert torch.equal(before, after)
        timed = {ahead: best_of(lambda: chain(model, diffusion, sample_generators(0, indices), shape, device, ahead),
                                repeat) for ahead in (False, True)}
    return {"batch": batch, "shape": list(shape), "steps": steps, "device": device, "chain_steps": chain_steps,
            "seeds_us_per_sample": {"before": 1e6 * seeds_before / batch, "after": 1e6 * seeds_after / batch,
                                    "ratio": seeds_before / seeds_after},
            "noise_ms_per_chunk": {"before": 1e3 * noise_before, "after": 1e3 * noise_after,
                                   "ratio": noise_before / noise_after},
            "chain_ms_per_chunk": {"before": 1e3 * timed[False], "after": 1e3 * timed[True],
                                   "ratio": timed[False] / timed[True]}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_sampling", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="samples per chunk (diffusion.sample's --batch-size)")
    p.add_argument("--shape", default="4,32,32", help="C,H,W of one sample")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--chain-steps", type=int, default=20, help="steps of the micro-DiT chain")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = tuple(int(v) for v in args.shape.split(","))
    result = run(args.batch, shape, args.steps, args.device, args.repeat, args.chain_steps)
    s, n, c = result["seeds_us_per_sample"], result["noise_ms_per_chunk"], result["chain_ms_per_chunk"]
    print(f"{'':<28}{'before':>12}{'after':>12}{'ratio':>9}")
    print(f"{'seeds, us per sample':<28}{s['before']:>12.2f}{s['after']:>12.2f}{s['ratio']:>8.1f}x")
    print(f"{'noise, ms per chunk':<28}{n['before']:>12.1f}{n['after']:>12.1f}{n['ratio']:>8.2f}x")
    print(f"{'micro-DiT chain, ms':<28}{c['before']:>12.1f}{c['after']:>12.1f}{c['ratio']:>8.2f}x")
    print(f"(batch {args.batch}, shape {args.shape}, {args.steps} steps of noise, {args.chain_steps} chain steps, "
          f"{args.device}, {args.threads} thread(s), best of {args.repeat})")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
