"""The paper's analysis tools, for any model built on :class:`common.topologies.ResidualBlock` (and timm's DeiT).

Four diagnostics; each *computes* a plain dict of numbers from a model (or a run directory) and
:func:`write_diagnostic` turns ``{label: result}`` into ``<kind>.json`` + ``<kind>.png``:

* :func:`hidden_state_norms` -- mean per-token L2 norm of each stream after each block (paper Fig. 2a):
  Pre-Norm's stream grows with depth, Post-Norm's stays at ~sqrt(dim), Siamese has one of each; Hyper-Connections
  report each of their ``n`` streams, Attention Residuals the newest source (the output magnitude of its paper).
* :func:`layer_removal` -- held-out loss when one block at a time returns its input unchanged, minus the
  intact loss (Fig. 2c): how much the network relies on each block.
* :func:`stream_contribution` -- mean |weight| of the learned fusion norms of a SiameseNorm model: per block
  ``post_norm{1,2}`` (X) vs ``pre_norm{1,2}`` (Y), and at the output ``norm_x`` vs ``norm_y`` (Fig. 6, sec. 5.3).
* :func:`grad_norm_trace` -- the global gradient norm a trainer logged (``train/grad_norm`` in
  ``metrics.jsonl``, a mean over each logging window; sec. 5.1).

On a trained DeiT run directory (``vision.train`` output), all at once::

    python -m scripts.diagnose --run runs/fmnist_deit_siamese --out runs/fmnist_deit_siamese/diagnostics

The hooks go on ``model.blocks`` (timm ViT and our DiT both have it); a block's output is a tensor (one stream, or
``n`` streams as ``(B, T, n, D)``), an ``(X, Y)`` tuple (SiameseNorm, ResiDual) or a list of sources (Attention
Residuals). Layer removal works on every state: a removed block returns the state it was given.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from common.cli import InputError
from common.durable import atomic_write_text
from common.plots import color_for, plain_ticks, plot_series, pyplot, series_style
from common.topologies import ResidualBlock, SiameseFusion, StreamStart

PathLike = Union[str, os.PathLike]
KINDS = ("hidden_state_norms", "layer_removal", "stream_contribution", "grad_norm")
GRAD_NORM_KEY = "train/grad_norm"
LOSS_KEY = "train/loss"


def model_blocks(model: nn.Module) -> Sequence[nn.Module]:
    """The residual blocks, in order (``model.blocks`` of timm ViTs and our DiT)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(f"{type(model).__name__} has no `blocks` attribute; pass blocks=[...] explicitly")
    return list(blocks)


def _streams(model: nn.Module, state) -> Dict[str, torch.Tensor]:
    """The named streams of a block's state, as the topology names them (``h``; ``x``, ``y``; ``s0``...; ``v``, the
    newest source of depth attention); ``h`` for a model without a topology's stream state (timm's own DeiT)."""
    streams = getattr(model, "streams", None)
    return streams.named_streams(state) if isinstance(streams, StreamStart) else {"h": state}


def _token_norm(t: torch.Tensor) -> float:
    return float(t.detach().float().norm(dim=-1).mean())


@torch.no_grad()
def hidden_state_norms(model: nn.Module, *inputs, blocks: Optional[Sequence[nn.Module]] = None) -> dict:
    """Mean per-token L2 norm of every stream entering block 0 (layer 0) and leaving each block (layer l+1).

    Runs ``model(*inputs)`` once in eval mode. Streams are ``h`` (one stream) or ``x`` (Post-Norm-like,
    normalised) and ``y`` (Pre-Norm-like accumulation) for two-stream models.
    """
    blocks = list(blocks) if blocks is not None else model_blocks(model)
    norms: Dict[str, list] = {}

    def record(state):
        for name, t in _streams(model, state).items():
            norms.setdefault(name, []).append(_token_norm(t))

    handles = [blocks[0].register_forward_pre_hook(lambda m, args: record(args[0]))]
    handles += [b.register_forward_hook(lambda m, args, out: record(out)) for b in blocks]
    was_training = model.training
    model.eval()
    try:
        model(*inputs)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return {"layers": list(range(len(blocks) + 1)), "norms": norms}


def _return_input(module, args, output):
    return args[0]


@torch.no_grad()
def layer_removal(model: nn.Module, loss_fn: Callable[[nn.Module], Union[float, Mapping]],
                  blocks: Optional[Sequence[nn.Module]] = None) -> dict:
    """Held-out loss with each block dropped in turn (the block returns its input state unchanged).

    ``loss_fn(model)`` evaluates the model on a fixed held-out set and returns the mean loss, or a dict
    with a ``loss`` entry (extra numeric entries, e.g. ``top1``, are reported alongside).
    Returns the intact loss, the loss with block ``i`` dropped, and the increase.
    """
    blocks = list(blocks) if blocks is not None else model_blocks(model)

    def evaluate() -> dict:
        out = loss_fn(model)
        out = dict(out) if isinstance(out, Mapping) else {"loss": out}
        return {k: float(v) for k, v in out.items() if isinstance(v, (int, float))}

    intact = evaluate()
    removed = []
    for block in blocks:
        handle = block.register_forward_hook(_return_input)
        try:
            removed.append(evaluate())
        finally:
            handle.remove()
    result = {"layers": list(range(len(blocks))), "intact_loss": intact["loss"],
              "removed_loss": [r["loss"] for r in removed],
              "loss_increase": [r["loss"] - intact["loss"] for r in removed]}
    for key in intact:
        if key != "loss":
            result[f"intact_{key}"] = intact[key]
            result[f"removed_{key}"] = [r[key] for r in removed]
    return result


def _mean_abs_weight(norm: nn.Module) -> float:
    weight = getattr(norm, "weight", None)
    if weight is None:
        raise ValueError(f"{type(norm).__name__} has no learned weight; stream contribution needs affine norms")
    return float(weight.detach().float().abs().mean())


@torch.no_grad()
def stream_contribution(model: nn.Module) -> dict:
    """Learned scales with which a SiameseNorm model reads its two streams.

    Per block and sublayer ``s``: mean |weight| of ``post_norm{s}`` (how strongly the sublayer input takes
    the normalised X stream) and of ``pre_norm{s}`` (the Y stream). At the output: ``norm_x`` vs ``norm_y``
    of the fusion. Both start at 1, so the ratio shows which stream training came to prefer.
    """
    blocks = [m for m in model.modules() if isinstance(m, ResidualBlock) and m.topology == "siamese"]
    fusions = [m for m in model.modules() if isinstance(m, SiameseFusion)]
    if not blocks or not fusions:
        raise ValueError(f"{type(model).__name__} has no SiameseNorm blocks/fusion; stream contribution is only "
                         "defined for topology=siamese")
    fusion = fusions[0]
    return {
        "layers": [b.layer_index for b in blocks],
        "x_scale": [[_mean_abs_weight(getattr(b, f"post_norm{s}")) for s in (1, 2)] for b in blocks],
        "y_scale": [[_mean_abs_weight(getattr(b, f"pre_norm{s}")) for s in (1, 2)] for b in blocks],
        "output_x_scale": _mean_abs_weight(fusion.norm_x),
        "output_y_scale": _mean_abs_weight(fusion.norm_y),
    }


def _as_float(v) -> float:
    return float(v)  # the logger writes non-finite numbers as the strings "nan"/"inf"; float() reads them


def grad_norm_trace(run_dir: PathLike) -> dict:
    """The global gradient norm (and loss) a trainer logged in ``run_dir/metrics.jsonl``, per logged step.

    Both trainers here log ``train/grad_norm`` as the mean over each ``train.log_every`` window of the
    finite steps; a trainer that does not log it gets a clear error.
    """
    from common.logging import read_metrics

    records = read_metrics(run_dir)
    rows = [r for r in records if GRAD_NORM_KEY in r]
    if not rows:
        raise InputError(f"{run_dir}/metrics.jsonl has no {GRAD_NORM_KEY!r} records: this trainer does not log "
                         "gradient norms, so there is no trace to show")
    return {"steps": [int(r["step"]) for r in rows], "grad_norm": [_as_float(r[GRAD_NORM_KEY]) for r in rows],
            "loss": [_as_float(r[LOSS_KEY]) if LOSS_KEY in r else None for r in rows]}


# ----------------------------------------------------------------------------- plots and files

_STREAM_NAMES = {"h": "", "x": " X (post-norm stream)", "y": " Y (pre-norm stream)", "v": " newest source"}


def stream_label(stream: str) -> str:
    """What a legend adds to a run's label for one of its streams (:func:`_streams`' names; ``s<i>``: stream i + 1)."""
    return _STREAM_NAMES[stream] if stream in _STREAM_NAMES else f" stream {int(stream[1:]) + 1}"


def _plot_hidden_state_norms(ax, results: Mapping[str, dict]) -> None:
    for label, r in results.items():
        streams = [s for s in r["norms"] if s.startswith("s")]  # Hyper-Connections' n streams
        for stream, values in r["norms"].items():
            style = {"marker": "o", "ls": "--" if stream == "x" else "-",
                     **series_style(label, streams.index(stream) if stream in streams else 0, len(streams))}
            plot_series(ax, r["layers"], values, label=f"{label}{stream_label(stream)}", ms=3, **style)
    ax.set_xlabel("layer (0 = embedding, l = after block l)")
    ax.set_ylabel("mean token L2 norm")
    ax.set_yscale("log")
    ax.set_title("hidden-state norm per layer")


def _plot_layer_removal(ax, results: Mapping[str, dict]) -> None:
    for label, r in results.items():
        plot_series(ax, r["layers"], r["loss_increase"], label=label, ms=3, **{"marker": "o", **series_style(label)})
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("dropped block")
    ax.set_ylabel("held-out loss increase")
    ax.set_title("layer-removal utilisation")


def _plot_stream_contribution(ax, results: Mapping[str, dict]) -> None:
    for label, r in results.items():
        pos = [b + s / 2 for b in r["layers"] for s in (0, 1)]  # attention at l, MLP at l + 0.5
        color = color_for(label)
        plot_series(ax, pos, [v for pair in r["x_scale"] for v in pair], label=f"{label} X (post_norm)", color=color,
                    marker="o", ms=3, ls="--")
        plot_series(ax, pos, [v for pair in r["y_scale"] for v in pair], label=f"{label} Y (pre_norm)", color=color,
                    marker="s", ms=3)
        out = max(pos) + 1.0
        ax.scatter([out], [r["output_x_scale"]], marker="D", color="black", label=f"{label} output norm_x")
        ax.scatter([out], [r["output_y_scale"]], marker="*", s=60, color="grey", label=f"{label} output norm_y")
    ax.set_xlabel("block (attention at l, MLP at l+0.5; output fusion last)")
    ax.set_ylabel("mean |norm weight|")
    ax.set_title("stream contribution (fusion-norm scales)")


def _plot_grad_norm(ax, results: Mapping[str, dict]) -> None:
    for label, r in results.items():
        plot_series(ax, r["steps"], r["grad_norm"], label=label, ms=4, **series_style(label))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("global grad norm (window mean)")
    ax.set_yscale("log")
    ax.set_title("gradient norm during training")


_PLOTS = {"hidden_state_norms": _plot_hidden_state_norms, "layer_removal": _plot_layer_removal,
          "stream_contribution": _plot_stream_contribution, "grad_norm": _plot_grad_norm}


def diagnostic_figure(kind: str, results: Mapping[str, dict], title: str = ""):
    """The figure of one diagnostic, ``{label: result}`` overlaid (a label naming a topology gets its colour)."""
    if kind not in _PLOTS:
        raise ValueError(f"unknown diagnostic {kind!r}; valid: {', '.join(_PLOTS)}")
    fig, ax = pyplot().subplots(figsize=(6.4, 4.0))
    _PLOTS[kind](ax, results)
    if title:
        ax.set_title(f"{ax.get_title()} -- {title}", fontsize=9)
    ax.grid(alpha=0.3)
    plain_ticks(ax)
    if results:
        ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def write_diagnostic(kind: str, results: Mapping[str, dict], out_dir: PathLike, title: str = "") -> Path:
    """Write ``{label: result}`` of one diagnostic as ``out_dir/<kind>.json`` and ``out_dir/<kind>.png``."""
    fig = diagnostic_figure(kind, results, title)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / f"{kind}.json", json.dumps(results, indent=1))
    path = out_dir / f"{kind}.png"
    fig.savefig(path, dpi=90)
    pyplot().close(fig)
    return path
