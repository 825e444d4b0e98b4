"""Train-step and activation-memory benchmark of the residual topologies, DeiT or DiT (``--family``).

Default mode: times a full training step (forward, backward, AdamW step) per variant, the variants in alternating
rounds so that machine noise hits all of them alike, and prints median step time, the ratio to the first variant
(the baseline), activation memory (bytes autograd saves for backward, any device), peak accelerator memory (GPU
only) and parameter counts; then one line per variant with its step-time and saved-activation ratios side by side.
``--memory``: no timing; the activation memory of one forward, fp32 and bf16 autocast, eager and (with
``--compile``) compiled, and its ratio to the first variant. Progress goes to stderr as it happens.

DeiT: cross-entropy on random images. DiT: MSE on the noise from random latents (the diffusion schedule costs
nothing next to the transformer).

Variants are topologies with the model's defaults, or a topology with model options after ``+``
(``TOPOLOGY[+OPTION[=VALUE]]``): ``siamese+recompute_norms`` is SiameseNorm with ``recompute_norms=True`` (its norm
chain fused into one autograd node; plain ``siamese`` runs the three norm modules), ``hc+hc_streams=2`` sets an
integer.

    python -m benchmarks.step --models tiny --img-size 32 --patch-size 4 --batch-size 64 --threads 1
    python -m benchmarks.step --models small --img-size 224 --patch-size 16 --batch-size 2 --memory \\
        --topologies pre,siamese+recompute_norms,siamese --compile --compile-backend aot_eager_decomp_partition
    python -m benchmarks.step --family dit --models DiT-S/2,DiT-B/2 --batch-size 8          # CPU, 32x32 latents
    python -m benchmarks.step --family dit --models DiT-B/2 --device cuda --dtype bfloat16 --batch-size 256
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable, Dict, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness import (
    add_common_args,
    alternate,
    apply_common_args,
    autocast as autocast_for,
    conditions,
    default_max_load,
    load_note,
    peak_memory_mb,
    print_memory_report,
    print_report,
    progress,
    restart_clock,
    saved_activation_mb,
    time_call,
)
from benchmarks.synthetic import deit_batch, dit_batch

DEIT_SIZES = {"tiny": "deit_tiny_siamese_patch16_224", "small": "deit_small_siamese_patch16_224",
              "base": "deit_base_siamese_patch16_224"}
# per family: --models, --num-classes, --batch-size, --rounds, --warmup
DEFAULTS = {"deit": dict(models="tiny", num_classes=10, batch_size=64, rounds=20, warmup=3),
            "dit": dict(models="DiT-S/2,DiT-B/2", num_classes=1000, batch_size=8, rounds=10, warmup=2)}


def variant_kwargs(variant: str) -> dict:
    """Model keyword arguments of a benchmark variant ``TOPOLOGY[+OPTION[=VALUE]]...``: ``siamese``,
    ``siamese+recompute_norms`` (``recompute_norms=True``), ``hc+hc_streams=2``, ``hc+hc_dynamic=false``."""
    import yaml

    topology, *options = variant.split("+")
    kwargs = {"topology": topology}
    for option in options:
        key, _, value = option.partition("=")
        kwargs[key] = yaml.safe_load(value) if value else True
    return kwargs


def deit_loss(model, batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def dit_loss(model, batch) -> torch.Tensor:
    """MSE between the predicted and the true noise (the epsilon half of a learned-sigma output)."""
    x, t, y, noise = batch
    return F.mse_loss(model(x, t, y)[:, : x.shape[1]].float(), noise)


def time_train_steps(
    builders: Dict[str, Callable[[], nn.Module]],
    make_batch: Callable[[], tuple],
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor],
    steps: int = 20,
    warmup: int = 3,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    compile: bool = False,
    compile_backend: str = "inductor",
    log: Callable[[str], None] = progress,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    sequential: bool = False,
    max_load: float | None = None,
) -> Dict[str, dict]:
    """Median train-step time (ms), peak memory (MB) and parameter count of each model.

    ``warmup_s`` is the seconds of the ``warmup`` steps (with ``compile``: the compiling).
    ``cpu_ms`` is the median CPU time of the process per step: on a CPU shared with other jobs it
    leaves out the time spent waiting for a core, so its ratios are steadier than wall-clock ones
    (with one thread; several threads add their spin-waits to it).

    ``dtype`` (bf16/fp16) runs forward and loss under autocast, as training does. Variants alternate, one
    step each per round (:func:`benchmarks.harness.alternate`), after ``warmup`` untimed steps each. ``log``
    receives a line per model built and warmed up, and one at least every 10 s while timing.

    ``make_optimizer`` (default: foreach AdamW) builds each model's optimizer, e.g. the trainer's fused AdamW.
    ``sequential``: each model is built, warmed up, timed and freed before the next is built, so its peak memory
    is its own (in turns, every model and its optimizer state is alive while any of them runs). Each variant's
    ``conditions`` (:func:`benchmarks.harness.conditions`; rounds above ``max_load``, default the core count, are
    LOADED) are those of the rounds it was timed in.
    """
    if sequential:
        results = {}
        for name, build in builders.items():
            results.update(time_train_steps({name: build}, make_batch, loss_fn, steps, warmup, device, dtype, compile,
                                            compile_backend, log, make_optimizer, max_load=max_load))
            gc.collect()
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
        return results
    device = torch.device(device)
    models, optimizers = {}, {}
    for name, build in builders.items():
        model = build().to(device).train()
        models[name] = torch.compile(model, backend=compile_backend) if compile else model
        optimizers[name] = (make_optimizer(model) if make_optimizer is not None
                            else torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05))
    batch = tuple(t.to(device) if torch.is_tensor(t) else t for t in make_batch())
    autocast = autocast_for(device, dtype)
    peak, activations = {}, {}

    def step(name):
        optimizers[name].zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(models[name], batch)
        loss.backward()
        optimizers[name].step()

    warmup_s = {}
    for name in builders:
        log(f"{name}: {warmup} warm-up steps{' (compiles)' if compile else ''}")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        warmup_s[name] = time_call(lambda: [step(name) for _ in range(warmup)], device).seconds
        peak[name] = peak_memory_mb(device)
        activations[name] = saved_activation_mb(models[name], loss_fn, batch, autocast)
        log(f"{name}: ready, {activations[name]:.1f} MB saved for backward")
    last_log = [time.perf_counter()]

    def on_round(round_index, runs):
        if time.perf_counter() - last_log[0] >= 10.0 or round_index == steps - 1:
            last_log[0] = time.perf_counter()
            log(f"round {round_index + 1}/{steps}: " + ", ".join(
                f"{name} {1e3 * statistics.median(r.seconds for r in rs):.1f} ms" for name, rs in runs.items())
                + f"; {load_note(runs.loads[-1], max_load)}")

    max_load = default_max_load() if max_load is None else max_load
    runs = alternate({name: (lambda name=name: step(name)) for name in builders}, steps, device, on_round=on_round)
    taken_under = conditions(runs, max_load)
    results = {
        name: dict(
            median_ms=1e3 * statistics.median(r.seconds for r in runs[name]),
            cpu_ms=1e3 * statistics.median(r.cpu_seconds for r in runs[name]),
            peak_mem_mb=peak[name],
            activation_mb=activations[name],
            params=sum(p.numel() for p in models[name].parameters()),
            warmup_s=warmup_s[name],
            conditions=taken_under,
        )
        for name in builders
    }
    del models, optimizers
    gc.collect()
    return results


def measure_activations(
    builders: Dict[str, Callable[[], nn.Module]],
    make_batch: Callable[[], tuple],
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor],
    device: str | torch.device = "cpu",
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    compile: bool = False,
    compile_backend: str = "inductor",
    log: Callable[[str], None] = progress,
) -> Dict[str, Dict[str, float]]:
    """Activation memory (MB, :func:`saved_activation_mb`) of one training-mode forward per variant, for each
    autocast dtype, eager and, with ``compile``, compiled (after one compiling forward and backward).

    Returns ``{variant: {"float32 eager": MB, "float32 compiled": MB, ...}}``.
    """
    device = torch.device(device)
    batch = tuple(t.to(device) if torch.is_tensor(t) else t for t in make_batch())
    results = {name: {} for name in builders}
    for name, build in builders.items():
        model = build().to(device).train()
        for dtype_name in dtypes:
            autocast = autocast_for(device, getattr(torch, dtype_name))
            results[name][f"{dtype_name} eager"] = saved_activation_mb(model, loss_fn, batch, autocast)
            log(f"{name} {dtype_name} eager: {results[name][f'{dtype_name} eager']:.1f} MB")
            if compile:
                torch._dynamo.reset()
                compiled = torch.compile(model, backend=compile_backend)
                with autocast:
                    loss = loss_fn(compiled, batch)
                loss.backward()
                model.zero_grad(set_to_none=True)
                results[name][f"{dtype_name} compiled"] = saved_activation_mb(compiled, loss_fn, batch, autocast)
                log(f"{name} {dtype_name} compiled ({compile_backend}): "
                    f"{results[name][f'{dtype_name} compiled']:.1f} MB")
        del model
        gc.collect()
    return results


def run_variants(args: argparse.Namespace, builders, make_batch, loss_fn, title: str, baseline: str):
    """Time train steps (default) or measure activation memory (``--memory``) of ``builders`` and print the table."""
    if args.memory:
        results = measure_activations(builders, make_batch, loss_fn, device=args.device,
                                      compile=args.compile, compile_backend=args.compile_backend)
        print_memory_report(results, baseline=baseline, title=(
            f"{title}, batch {args.batch_size}, {args.device}: activation memory of one forward (saved for backward; "
            f"parameters excluded){', compiled with ' + args.compile_backend if args.compile else ''}"))
        return results
    results = time_train_steps(
        builders, make_batch, loss_fn, steps=args.rounds, warmup=args.warmup, device=args.device,
        dtype=getattr(torch, args.dtype), compile=args.compile, compile_backend=args.compile_backend,
        max_load=args.max_load,
    )
    print_report(results, baseline=baseline, title=(
        f"{title}, batch {args.batch_size}, {args.dtype}, {args.device}, {torch.get_num_threads()} threads"
        f"{', compiled with ' + args.compile_backend if args.compile else ''}, "
        f"median of {args.rounds} train steps (fwd+bwd+AdamW)"))
    return results


def parse_args(argv: Sequence[str] | None) -> tuple:
    """The parsed arguments, with the family's defaults filled in, and the parser (for its errors)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(DEFAULTS), default="deit",
                        help="deit (timm's DeiT on images) or dit (DiT on latents)")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated models: DeiT sizes ({', '.join(DEIT_SIZES)}; default "
                             f"{DEFAULTS['deit']['models']}) or DiT names (default {DEFAULTS['dit']['models']})")
    parser.add_argument("--topologies", default="pre,siamese,post",
                        help="comma-separated variants (topologies, or TOPOLOGY+OPTION[=VALUE], e.g. "
                             "siamese+recompute_norms); the first is the baseline")
    parser.add_argument("--img-size", type=int, default=32, help="deit: image height/width")
    parser.add_argument("--patch-size", type=int, default=4, help="deit: patch size")
    parser.add_argument("--latent-size", type=int, default=32, help="dit: latent height/width (32 = 256px images)")
    parser.add_argument("--in-channels", type=int, default=4, help="dit: latent channels")
    parser.add_argument("--num-classes", type=int, default=None, help="default: deit 10, dit 1000")
    parser.add_argument("--batch-size", type=int, default=None, help="default: deit 64, dit 8")
    add_common_args(parser, rounds=None, rounds_help="timed train steps per variant, alternating (default: deit "
                                                     "20, dit 10)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per variant (default: deit 3, dit 2)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="autocast dtype (float32: no autocast, TF32 matmuls on CUDA)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each model first")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend; aot_eager_decomp_partition makes inductor's forward/backward "
                             "split (same saved tensors) without its code generation, so compiles fast on CPU")
    parser.add_argument("--memory", action="store_true",
                        help="measure activation memory only (fp32 and bf16 autocast; eager, and compiled with "
                             "--compile) instead of timing train steps")
    parser.add_argument("--grad-checkpointing", action="store_true")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.family].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args, parser


def main(argv: Sequence[str] | None = None) -> Dict[str, dict]:
    """``{model: {variant: figures}}``."""
    args, parser = parse_args(argv)
    restart_clock()
    names = args.models.split(",")
    if args.family == "dit":
        from diffusion.models import DiT_models as registry
    else:
        registry = DEIT_SIZES
    unknown = [n for n in names if n not in registry]
    if unknown:
        parser.error(f"unknown {args.family} model(s) {', '.join(unknown)}; valid names are {', '.join(registry)}")
    apply_common_args(args)
    if args.device.startswith("cuda"):  # TF32 matmuls: the fp32 setting of the recipes
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    variants = args.topologies.split(",")

    if args.family == "dit":
        batch, loss_fn = dit_batch(args.batch_size, args.latent_size, args.in_channels, args.num_classes), dit_loss

        def create(name, variant):
            return registry[name](input_size=args.latent_size, in_channels=args.in_channels,
                                  num_classes=args.num_classes, **variant_kwargs(variant))

        def title(name):
            return f"{name} {args.latent_size}x{args.latent_size} latents"
    else:
        import timm

        import vision  # noqa: F401  (registers the DeiT topologies)

        batch, loss_fn = deit_batch(args.batch_size, args.img_size, args.num_classes), deit_loss

        def create(name, variant):
            return timm.create_model(registry[name], img_size=args.img_size, patch_size=args.patch_size,
                                     num_classes=args.num_classes, **variant_kwargs(variant))

        def title(name):
            return f"DeiT-{name} {args.img_size}px/patch {args.patch_size}"

    def builder(name, variant):
        def build():
            torch.manual_seed(0)
            model = create(name, variant)
            model.set_grad_checkpointing(args.grad_checkpointing)
            return model
        return build

    all_results = {}
    for name in names:
        progress(f"{title(name)}: {', '.join(variants)}")
        all_results[name] = run_variants(args, {v: builder(name, v) for v in variants}, lambda: batch, loss_fn,
                                         title=title(name), baseline=variants[0])
    return all_results


if __name__ == "__main__":
    main()
