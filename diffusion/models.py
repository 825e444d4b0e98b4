"""DiT (Peebles & Xie, 2023) with adaLN-Zero on the shared residual block: Pre-Norm, Post-Norm, Mix-LN, SiameseNorm.

The network follows the official facebookresearch/DiT model file (same module names, same
initialisation, same timestep and position embeddings), so the official checkpoints load into the
Pre-Norm model unchanged. Only the block wiring differs between topologies, and that lives in
:mod:`common.topologies` (one class per topology); a DiT block supplies the two sublayers
``gate * attn(modulate(h, shift, scale))`` and ``gate * mlp(modulate(h, shift, scale))``, where ``h``
is the block's non-affine input LayerNorm output (docs/method.md section 3):

* ``pre``     -- ``Y <- Y + gate*F(modulate(LN(Y)))``; ``norm1/norm2`` non-affine (no keys), as official DiT.
* ``post``    -- ``X <- LN(X + gate*F(modulate(X)))``; ``norm1/norm2`` affine (our choice: Post-Norm's
  norm sits on the residual path, where an affine norm is the usual Post-Norm block).
* ``siamese`` -- ``X <- LN_post(X); Z = gate*F(modulate(LN_in(X + LN_pre(Y)))); X <- X + Z/c_l; Y <- Y + Z``
  with affine ``pre_norm{i}/post_norm{i}`` and a non-affine ``input_norm{i}``; after the last block
  ``fusion = LN_x(X) + LN_y(Y)`` feeds the final layer.
* ``mixln``   -- ``post`` blocks first, ``pre`` blocks after.
* ``residual`` (ResiDual) and ``deepnorm`` -- baselines from :mod:`common.topologies`, with the gated sublayer.
* ``hc``, ``mhc`` (Hyper-Connections, manifold-constrained), ``attnres``, ``attnres_block`` (Attention Residuals)
  -- the multi-stream and cross-layer designs, around DiT's own non-affine norms and gated sublayers.

Not offered for DiT: ``sandwich`` (a LayerNorm on the gated output would rescale away adaLN-Zero's
gate), ``layerscale`` (the adaLN gate already is a learned per-channel gain on each update, zero at
init) and ``dyt`` (DiT's input norms are non-affine and modulated; a DyT variant is a separate study).

Usage::

    from diffusion.models import DiT_models
    model = DiT_models["DiT-B/2"](topology="siamese")       # input_size=32 latents (256px images)
    out = model(x, t, y)                                     # (N, 2C, H, W) with learned sigma

The model's description (:class:`diffusion.spec.DiTSpec`) and the checkpoint formats
(:func:`diffusion.checkpoints.load_dit`) live beside this file.

The constructor's defaults are the published DiT's (DiT-XL/2 on 256px ImageNet latents, label dropout 0.1, learned
sigma), as timm's model constructors keep their papers'; training recipes set their own in ``configs/``.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Dict, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from timm.layers import AttentionRope, GluMlp, Mlp, PatchEmbed, RotaryEmbeddingCat

from common.cli import InputError
from common.checkpoint import convert_state_dict
from common.topologies import LN_EPS, ResidualBlock, resolve_topology, topology_names

DIT_TOPOLOGIES = topology_names("dit")

Tensor = torch.Tensor


def modulate(x: Tensor, shift: Optional[Tensor], scale: Tensor) -> Tensor:
    """adaLN: per-sample shift (none with LightningDiT's ``wo_shift``) and scale broadcast over the tokens."""
    x = x * (1 + scale.unsqueeze(1))
    return x if shift is None else x + shift.unsqueeze(1)


def affine_layer_norm(dim: int) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=LN_EPS)


def plain_layer_norm(dim: int) -> nn.LayerNorm:
    """DiT's own LayerNorm: no affine parameters, adaLN supplies shift and scale."""
    return nn.LayerNorm(dim, elementwise_affine=False, eps=LN_EPS)


def rms_norm(dim: int, **factory) -> nn.RMSNorm:
    """LightningDiT's RMSNorm: a learned weight, epsilon 1e-6, in every place a LayerNorm would be."""
    return nn.RMSNorm(dim, eps=LN_EPS, **factory)


# The backbone switches (LightningDiT's): norm -> (the streams' norms, a sublayer's input norm, q/k norms), the MLP.
NORMS = {"layernorm": (affine_layer_norm, plain_layer_norm, nn.LayerNorm), "rmsnorm": (rms_norm, rms_norm, rms_norm)}
MLPS = ("gelu", "swiglu")


def check_backbone(norm: str, mlp: str) -> None:
    if norm not in NORMS:
        raise InputError(f"norm={norm!r} is not a norm; choose one of {', '.join(NORMS)}")
    if mlp not in MLPS:
        raise InputError(f"mlp={mlp!r} is not an MLP; choose one of {', '.join(MLPS)}")


def mlp_layer(mlp: str, hidden_size: int, mlp_ratio: float) -> nn.Module:
    """DiT's GELU (tanh) MLP, or LightningDiT's SwiGLU with 2/3 of the hidden width (timm's ``GluMlp``: ``fc1``
    gives both halves, SiLU on the first)."""
    hidden = int(hidden_size * mlp_ratio)
    if mlp == "swiglu":
        return GluMlp(hidden_size, 2 * int(2 / 3 * hidden), act_layer=nn.SiLU, gate_last=False)
    return Mlp(hidden_size, hidden, act_layer=partial(nn.GELU, approximate="tanh"))


def sincos_pos_embed_1d(dim: int, positions: Tensor) -> Tensor:
    """``[sin(p * w), cos(p * w)]`` with ``w_k = 10000^(-k / (dim/2))``, computed in float64."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    angles = positions.reshape(-1, 1).double() * omega
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def sincos_pos_embed_2d(dim: int, grid_size: int) -> Tensor:
    """Fixed 2-D sin-cos position embedding ``(grid_size**2, dim)`` as the official DiT (and MAE) compute it.

    The first half of the channels encodes the column, the second half the row (the official code's
    ``meshgrid(w, h)`` order); tokens are in row-major order.
    """
    if dim % 4:
        raise ValueError(f"hidden size {dim} must be divisible by 4 for the 2-D sin-cos position embedding")
    rows, cols = torch.meshgrid(torch.arange(grid_size), torch.arange(grid_size), indexing="ij")
    return torch.cat([sincos_pos_embed_1d(dim // 2, cols), sincos_pos_embed_1d(dim // 2, rows)], dim=1)


class TimestepEmbedder(nn.Module):
    """Scalar timesteps -> vectors: sinusoidal features (official DiT frequencies) then a 2-layer SiLU MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )

    @staticmethod
    def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
        """``[cos(t * f), sin(t * f)]`` with ``f_k = max_period^(-k / half)`` (official DiT divides by ``half``)."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t: Tensor) -> Tensor:
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class LabelEmbedder(nn.Module):
    """Class labels -> vectors; drops labels to the null class ``num_classes`` for classifier-free guidance."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def token_drop(self, labels: Tensor, force_drop_ids: Optional[Tensor] = None) -> Tensor:
        if force_drop_ids is None:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop = force_drop_ids == 1
        return torch.where(drop, torch.full_like(labels, self.num_classes), labels)

    def forward(self, labels: Tensor, train: bool, force_drop_ids: Optional[Tensor] = None) -> Tensor:
        if (train and self.dropout_prob > 0) or force_drop_ids is not None:
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)


class DiTBlock(ResidualBlock):
    """DiT's sublayers (attention and MLP, each adaLN-Zero modulated and gated) for a residual topology.

    ``forward(state, c)`` computes the modulation vectors from the conditioning ``c`` once and hands them to the
    topology's update as the sublayers' ``ctx``. Built on a topology by
    :meth:`common.topologies.TopologyPlan.build_block`; ``**topology_options`` go to the topology's block.

    The backbone switches (LightningDiT's; any topology): ``norm="rmsnorm"`` puts an RMSNorm in every norm's place
    (the sublayers' input norms, the streams' norms, QK-norm's), ``mlp="swiglu"``, ``qk_norm``, ``wo_shift`` (adaLN
    scales and gates without shifts: four vectors, not six) and ``rope``, the 2-D rotary embedding that attention
    applies to queries and keys (one module shared by every block).
    """

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0, layer_index: int = 0, *,
                 norm: str = "layernorm", mlp: str = "gelu", qk_norm: bool = False, wo_shift: bool = False,
                 rope: Optional[RotaryEmbeddingCat] = None, **topology_options):
        stream_norm, input_norm, qk_norm_layer = NORMS[norm]
        super().__init__(hidden_size, layer_index, norm_layer=stream_norm, input_norm_layer=input_norm,
                         **topology_options)
        self.attn = AttentionRope(hidden_size, num_heads=num_heads, qkv_bias=True, num_prefix_tokens=0,
                                  qk_norm=qk_norm, norm_layer=qk_norm_layer)
        self.mlp = mlp_layer(mlp, hidden_size, mlp_ratio)
        self.modulations = 4 if wo_shift else 6
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, self.modulations * hidden_size))
        self.rope = rope

    def forward(self, state, c: Tensor):
        return super().forward(state, self.adaLN_modulation(c))

    def modulation(self, ctx: Tensor, sublayer: int):
        """``(shift or None, scale, gate)`` of sublayer 0 (attention) or 1 (MLP)."""
        parts = ctx.chunk(self.modulations, dim=1)
        if self.modulations == 4:
            return (None, *parts[2 * sublayer: 2 * sublayer + 2])
        return parts[3 * sublayer: 3 * sublayer + 3]

    def sublayer1(self, h: Tensor, ctx: Optional[Tensor]) -> Tensor:
        shift, scale, gate = self.modulation(ctx, 0)
        rope = self.rope.get_embed() if self.rope is not None else None
        return gate.unsqueeze(1) * self.attn(modulate(h, shift, scale), rope=rope)

    def sublayer2(self, h: Tensor, ctx: Optional[Tensor]) -> Tensor:
        shift, scale, gate = self.modulation(ctx, 1)
        return gate.unsqueeze(1) * self.mlp(modulate(h, shift, scale))


class FinalLayer(nn.Module):
    """adaLN-modulated non-affine LayerNorm (``norm="rmsnorm"``: LightningDiT's RMSNorm) and a linear map to
    ``patch*patch*out_channels`` per token."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int, norm: str = "layernorm"):
        super().__init__()
        self.norm_final = NORMS[norm][1](hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


def guide(out: Tensor, cfg_scale: float, guided: int) -> Tensor:
    """Classifier-free guidance of ``[conditional; unconditional]`` outputs: the first ``guided`` channels become
    ``uncond + cfg_scale * (cond - uncond)`` in both halves, the others stay the network's own."""
    eps, rest = out[:, :guided], out[:, guided:]
    cond, uncond = eps.chunk(2, dim=0)
    guided_eps = uncond + cfg_scale * (cond - uncond)
    return torch.cat([torch.cat([guided_eps, guided_eps], dim=0), rest], dim=1)


class DiT(nn.Module):
    """Class-conditional latent diffusion transformer with a switchable residual topology.

    Args:
        input_size: latent height/width (32 for 256px images through the SD VAE).
        patch_size: 2, 4 or 8 in the published family.
        in_channels: latent channels (4).
        hidden_size, depth, num_heads, mlp_ratio: transformer size.
        class_dropout_prob: label dropout for classifier-free guidance (null class id ``num_classes``).
        num_classes: number of classes (1000 for ImageNet).
        learn_sigma: output ``2*in_channels`` channels (epsilon and the variance interpolation).
        topology: ``pre`` (the published DiT), ``post``, ``siamese``, or another of :data:`DIT_TOPOLOGIES`.
        norm, mlp, qk_norm, wo_shift, rope: the backbone switches (:class:`DiTBlock`; LightningDiT's are
            ``norm="rmsnorm", mlp="swiglu", rope=True``); they compose with every topology.
        **topology_options: the topology's options (``normalized_input``, ``depth_scaling``, ``recompute_norms``,
            ``mixln_post_blocks``, ``hc_streams``, ...: each topology's registration in :mod:`common.topologies`
            names its own and their defaults; an option of another topology is refused).
    """

    def __init__(
        self,
        input_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        topology: str = "pre",
        norm: str = "layernorm",
        mlp: str = "gelu",
        qk_norm: bool = False,
        wo_shift: bool = False,
        rope: bool = False,
        **topology_options,
    ):
        super().__init__()
        check_backbone(norm, mlp)
        plan = resolve_topology(topology, depth, "dit", **topology_options)
        if input_size % patch_size:
            raise InputError(f"input_size={input_size} is not divisible by patch_size={patch_size}; "
                             "pick a latent size that is a multiple of the patch size")
        if hidden_size % num_heads:
            raise InputError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
        self.input_size = input_size
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.learn_sigma = learn_sigma
        self.num_classes = num_classes
        self.topology = topology
        self.topology_plan = plan
        self.block_topologies = plan.block_topologies
        self.grad_checkpointing = False

        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size, bias=True)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # A frozen parameter, not a buffer, so that the official checkpoints' `pos_embed` key and
        # parameter counts (which include it) match.
        self.pos_embed = nn.Parameter(torch.zeros(1, self.x_embedder.num_patches, hidden_size), requires_grad=False)
        grid = input_size // patch_size
        # LightningDiT's 2-D rotary embedding (EVA's layout: rows then columns, frequency pairs interleaved)
        self.rope = RotaryEmbeddingCat(hidden_size // num_heads, in_pixels=False, feat_shape=[grid, grid]) if rope else None
        self.streams = plan.streams(hidden_size)
        backbone = dict(norm=norm, mlp=mlp, qk_norm=qk_norm, wo_shift=wo_shift, rope=self.rope)
        self.blocks = nn.ModuleList(plan.build_block(DiTBlock, i, hidden_size, num_heads, mlp_ratio, layer_index=i,
                                                     **backbone) for i in range(depth))
        self.fusion = plan.output(hidden_size, NORMS[norm][0], final_norm=False)
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels, norm)
        self.initialize_weights()

    def initialize_weights(self):
        """The official DiT init: xavier linears, frozen sin-cos positions, N(0, 0.02) embeddings, adaLN-Zero."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        grid = int(self.x_embedder.num_patches ** 0.5)
        with torch.no_grad():
            self.pos_embed.copy_(sincos_pos_embed_2d(self.pos_embed.shape[-1], grid).float().unsqueeze(0))
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))  # like a linear layer over the flattened patch
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)
        self.topology_plan.init_weights(self.blocks)

    def set_grad_checkpointing(self, enable: bool = True):
        """Recompute each block in the backward pass (saves activation memory, costs ~one more forward)."""
        self.grad_checkpointing = enable

    def unpatchify(self, x: Tensor) -> Tensor:
        """``(N, T, p*p*C)`` tokens -> ``(N, C, H, W)`` image."""
        c, p = self.out_channels, self.patch_size
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], h, w, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x: Tensor, t: Tensor, y: Tensor, force_drop_ids: Optional[Tensor] = None,
                hidden_after: Optional[int] = None):
        """Predict ``(N, out_channels, H, W)`` from latents ``x (N, C, H, W)``, timesteps ``t (N,)``, labels ``y (N,)``.

        Labels are dropped to the null class with ``class_dropout_prob`` in training mode;
        ``force_drop_ids`` (1 = drop) overrides that choice per sample. The output has the dtype of
        the residual streams (fp32 under bf16 autocast), so the diffusion loss is computed in fp32.
        ``t`` may be continuous (SiT's times in [0, 1]); the embedding takes any real value.
        ``hidden_after=k`` also returns the tokens ``(N, T, D)`` after block ``k`` (1-based; REPA aligns them):
        :meth:`common.topologies.StreamStart.accumulated`, ``embedding + sum of the updates``, the quantity Pre-Norm's
        stream is (``Y`` for SiameseNorm and ResiDual).
        """
        tokens = self.x_embedder(x) + self.pos_embed
        t_emb = self.t_embedder(t)
        c = t_emb + self.y_embedder(y, self.training, force_drop_ids)
        state = self.streams(tokens, t_emb)  # timestep-aware routing reads t_emb
        use_checkpoint = self.grad_checkpointing and torch.is_grad_enabled()
        hidden = None
        for i, block in enumerate(self.blocks):
            state = checkpoint(block, state, c, use_reentrant=False) if use_checkpoint else block(state, c)
            if i + 1 == hidden_after:
                hidden = self.streams.accumulated(state)
        out = self.unpatchify(self.final_layer(self.fusion(state), c))
        # Under autocast the streams stay fp32 but the last linear returns bf16; hand the loss the stream dtype.
        out = out.to(tokens.dtype)
        return out if hidden_after is None else (out, hidden)

    def forward_with_cfg(self, x: Tensor, t: Tensor, y: Tensor, cfg_scale: float,
                         guided_channels: Union[int, str, None] = None) -> Tensor:
        """Classifier-free guidance in one batched forward, in the official DiT calling convention.

        The batch is ``[conditional half, unconditional half]``: ``y`` holds the labels then the null
        class, and ``x`` the same latents twice (only the first half of ``x`` is read). The first
        ``guided_channels`` output channels get ``uncond + cfg_scale * (cond - uncond)``, copied to both
        halves; the remaining channels (the rest of epsilon and the learned variance) are the model's
        own output. The official DiT guides 3 of the 4 latent channels (``guided_channels=3``); the
        default None does so too, and guides every channel of a model with fewer (``min(3, in_channels)``);
        ``"all"`` guides every epsilon channel.
        """
        n = self.in_channels
        guided = n if guided_channels == "all" else min(3, n) if guided_channels is None else guided_channels
        if not isinstance(guided, int) or isinstance(guided, bool) or not 0 < guided <= n:
            raise InputError(f"guided_channels must be an int in [1, {n}] or 'all', got {guided_channels!r}")
        if x.shape[0] % 2:
            raise ValueError(f"forward_with_cfg expects an even batch [conditional; unconditional], got {x.shape[0]}")
        half = x[: x.shape[0] // 2]
        return guide(self(torch.cat([half, half], dim=0), t, y), cfg_scale, guided)  # self: a compiled model's forward

    @staticmethod
    def convert_state_dict(state_dict: Dict[str, Tensor], model: Optional["DiT"] = None) -> Dict[str, Tensor]:
        """Public layouts -> ours (called by :func:`common.checkpoint.load_weights` before a strict load).

        * official facebookresearch/DiT (Pre-Norm) and SiT: the names are already ours;
        * public SiameseNorm DiT: ``blocks.i.prenorm{j}/postnorm{j}`` -> ``pre_norm{j}/post_norm{j}``,
          top-level ``postnorm`` (applied to X) -> ``fusion.norm_x``, ``prenorm`` (applied to Y) -> ``fusion.norm_y``;
        * REPA's projector (``projectors.*``, :mod:`diffusion.repa`) trains only: dropped for a model without one;
        * LightningDiT: SwiGLU's ``mlp.w12``/``mlp.w3`` -> ``mlp.fc1``/``mlp.fc2`` (timm's ``GluMlp``); its rotary
          tables (``feat_rope.*``) are computed here, not loaded.
        """
        if model is None or not hasattr(model, "projectors"):
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith("projectors.")}
        if any(".mlp.w12." in k or k.startswith("feat_rope.") for k in state_dict):
            state_dict = {k.replace(".mlp.w12.", ".mlp.fc1.").replace(".mlp.w3.", ".mlp.fc2."): v
                          for k, v in state_dict.items() if not k.startswith("feat_rope.")}
        if not any(k.startswith(("prenorm.", "postnorm.")) or ".prenorm" in k or ".postnorm" in k
                   for k in state_dict):
            return dict(state_dict)
        depth = len(model.blocks) if model is not None else 1 + max(
            (int(k.split(".")[1]) for k in state_dict if k.startswith("blocks.")), default=-1)
        prefix_map = {"prenorm.": "fusion.norm_y.", "postnorm.": "fusion.norm_x."}
        for i in range(depth):
            for j in (1, 2):
                prefix_map[f"blocks.{i}.prenorm{j}."] = f"blocks.{i}.pre_norm{j}."
                prefix_map[f"blocks.{i}.postnorm{j}."] = f"blocks.{i}.post_norm{j}."
        return convert_state_dict(state_dict, prefix_map)


# Depth / hidden size / heads of the published family (DiT paper Table 1).
DIT_SIZES = {
    "S": dict(depth=12, hidden_size=384, num_heads=6),
    "B": dict(depth=12, hidden_size=768, num_heads=12),
    "L": dict(depth=24, hidden_size=1024, num_heads=16),
    "XL": dict(depth=28, hidden_size=1152, num_heads=16),
}
DIT_CONFIGS = {f"DiT-{size}/{patch}": {**dims, "patch_size": patch} for size, dims in DIT_SIZES.items()
               for patch in (2, 4, 8)}
# LightningDiT (hustvl/LightningDiT, models/lightningdit.py): its sizes, and the backbone and latents its published
# models have (RMSNorm, SwiGLU, 2-D RoPE, no learned sigma, the VA-VAE's 16x16x32 latents of 256px images).
LIGHTNINGDIT_SIZES = {**DIT_SIZES, "1p0B": dict(depth=24, hidden_size=1536, num_heads=24),
                      "1p6B": dict(depth=28, hidden_size=1792, num_heads=28)}
LIGHTNINGDIT_BACKBONE = dict(norm="rmsnorm", mlp="swiglu", rope=True, learn_sigma=False, in_channels=32, input_size=16)
DIT_CONFIGS.update({f"LightningDiT-{size}/{patch}": {**dims, "patch_size": patch, **LIGHTNINGDIT_BACKBONE}
                    for size, dims in LIGHTNINGDIT_SIZES.items() if size != "S" for patch in (1, 2)})


def _factory(name: str) -> Callable[..., DiT]:
    def build(**kwargs) -> DiT:
        return DiT(**{**DIT_CONFIGS[name], **kwargs})

    build.__name__ = name.replace("-", "_").replace("/", "_")
    build.__doc__ = f"{name}; keyword arguments (topology=..., input_size=...) go to DiT."
    return build


DiT_models: Dict[str, Callable[..., DiT]] = {name: _factory(name) for name in DIT_CONFIGS}
