"""DeiT with a switchable residual topology (Pre-Norm, Post-Norm, Mix-LN, SiameseNorm), registered with timm.

The model is timm's :class:`~timm.models.vision_transformer.VisionTransformer` (patch embedding,
position embedding, class token, pooling, head, weight init, pretrained loading) with its blocks
replaced by :class:`DeiTBlock`, whose residual wiring is :class:`common.residual.ResidualBlock`.

After ``import vision`` these names exist in timm's registry::

    deit_{tiny,small,base}_{siamese,post,mixln}_patch16_224

Pre-Norm DeiT stays timm's own ``deit_*_patch16_224``; ``topology="pre"`` here builds the same
network with the same state-dict keys (tested equal to timm).
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import Attention, LayerNorm, LayerScale, Mlp, get_norm_layer
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer

from common.checkpoint import convert_state_dict
from common.residual import (
    DyT,
    ResidualBlock,
    block_topologies,
    build_fusion,
    check_topology,
    deepnorm_init_,
    init_streams,
)


class DeiTBlock(ResidualBlock):
    """timm's ViT block (fused SDPA attention, MLP, optional LayerScale) on a shared residual topology.

    Accepts the keyword arguments timm's ``VisionTransformer`` passes to ``block_fn``. ``layer_index`` is the
    0-based block index (it sets the Siamese depth scale and picks the block's topology from ``topologies``);
    timm's own ``depth=i`` keyword is ignored because timm passes it only from 1.0.23 on
    (:class:`_IndexedBlockFactory` counts the blocks instead).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_attn_norm: bool = False,
        scale_mlp_norm: bool = False,
        proj_bias: bool = True,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        init_values: Optional[float] = None,
        drop_path: float = 0.0,
        act_layer=nn.GELU,
        norm_layer=nn.LayerNorm,
        mlp_layer=Mlp,
        attn_layer=Attention,
        depth: Optional[int] = None,
        device=None,
        dtype=None,
        *,
        layer_index: int = 0,
        topologies: Sequence[str] = ("siamese",),
        normalized_input: bool = True,
        depth_scaling: bool = True,
        recompute_norms: bool = False,
    ):
        dd = {"device": device, "dtype": dtype}
        super().__init__(
            dim,
            layer_index=layer_index,
            topology=topologies[layer_index] if len(topologies) > 1 else topologies[0],
            normalized_input=normalized_input,
            depth_scaling=depth_scaling,
            recompute_norms=recompute_norms,
            norm_layer=partial(norm_layer, **dd),
            drop_path=drop_path,
            num_blocks=len(topologies),
        )
        self.attn = attn_layer(
            dim,
            num_heads=num_heads,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            scale_norm=scale_attn_norm,
            proj_bias=proj_bias,
            attn_drop=attn_drop,
            proj_drop=proj_drop,
            norm_layer=norm_layer,
            **dd,
        )
        self.ls1 = LayerScale(dim, init_values=init_values, **dd) if init_values else nn.Identity()
        self.mlp = mlp_layer(
            in_features=dim,
            hidden_features=int(dim * mlp_ratio),
            act_layer=act_layer,
            norm_layer=norm_layer if scale_mlp_norm else None,
            bias=proj_bias,
            drop=proj_drop,
            **dd,
        )
        self.ls2 = LayerScale(dim, init_values=init_values, **dd) if init_values else nn.Identity()

    def _attn(self, h: torch.Tensor) -> torch.Tensor:
        return self.ls1(self.attn(h))

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.ls2(self.mlp(h))

    def forward(self, state):
        state = self.residual(1, state, self._attn)
        return self.residual(2, state, self._mlp)


class _IndexedBlockFactory:
    """``block_fn`` for timm's ``VisionTransformer``: builds :class:`DeiTBlock` ``i`` for the ``i``-th call.

    timm creates the blocks in order, but tells a block its index (``depth=i``) only from 1.0.23 on; with an
    older timm every block would silently be block 0 (Siamese ``c_l = sqrt(2)``, Mix-LN all Post-Norm).
    """

    def __init__(self, **block_kwargs):
        self.block_kwargs = block_kwargs
        self.built = 0

    def __call__(self, **timm_kwargs) -> DeiTBlock:
        timm_kwargs.pop("depth", None)
        block = DeiTBlock(**timm_kwargs, layer_index=self.built, **self.block_kwargs)
        self.built += 1
        return block


class SiameseNormVisionTransformer(VisionTransformer):
    """timm ViT/DeiT whose blocks use a switchable residual topology.

    Args:
        topology: ``siamese`` (default), ``pre``, ``post``, ``mixln``, or a baseline: ``residual``
            (ResiDual), ``sandwich`` (Peri-LN), ``deepnorm``, ``layerscale`` (Pre-Norm + LayerScale,
            ``init_values`` default 1e-5, 1e-6 deeper than 18 blocks as in CaiT), ``dyt`` (Pre-Norm with
            Dynamic Tanh for every LayerNorm). See :mod:`common.residual`.
        normalized_input: SiameseNorm's ``LN_in`` (paper Table 3 "Normalized Input").
        depth_scaling: SiameseNorm's ``1/sqrt(2(l+1))`` on the ``X`` update (Table 3 "Depth-wise Scaling").
        recompute_norms: recompute SiameseNorm's norm chain in backward instead of storing it: one stream
            tensor per sublayer less activation memory, same results, up to 3% more CPU step time
            (see :class:`common.residual.ResidualBlock`).
        mixln_post_blocks: Mix-LN only; number of leading Post-Norm blocks (default: a quarter of depth).
        **kwargs: every ``VisionTransformer`` argument (``img_size``, ``patch_size``, ``embed_dim``,
            ``depth``, ``num_heads``, ``drop_path_rate``, ``num_classes``, ...).
    """

    def __init__(
        self,
        topology: str = "siamese",
        normalized_input: bool = True,
        depth_scaling: bool = True,
        mixln_post_blocks: Optional[int] = None,
        recompute_norms: bool = False,
        **kwargs,
    ):
        check_topology(topology)
        if kwargs.get("block_fn") is not None:
            raise ValueError("block_fn is set by SiameseNormVisionTransformer; choose a `topology` instead")
        depth = kwargs.get("depth", 12)
        if topology == "layerscale" and not kwargs.get("init_values"):
            kwargs["init_values"] = 1e-5 if depth <= 18 else 1e-6
        if topology == "dyt":
            kwargs["norm_layer"] = DyT
        topologies = block_topologies(topology, depth, mixln_post_blocks)
        block_fn = _IndexedBlockFactory(
            topologies=topologies, normalized_input=normalized_input, depth_scaling=depth_scaling,
            recompute_norms=recompute_norms,
        )
        super().__init__(block_fn=block_fn, **kwargs)
        if block_fn.built != depth:
            raise RuntimeError(f"timm built {block_fn.built} blocks for depth={depth}; this timm version is not supported")
        self.topology = topology
        self.block_topologies = topologies
        # timm made `norm` a LayerNorm (Identity when pooling uses fc_norm); swap in the stream fusion.
        norm_layer = get_norm_layer(kwargs.get("norm_layer")) or LayerNorm
        self.norm = build_fusion(
            self.embed_dim,
            topology,
            last_block_topology=topologies[-1] if topologies else "pre",
            final_norm=not isinstance(self.norm, nn.Identity),
            norm_layer=norm_layer,
        )
        if topology == "deepnorm":
            deepnorm_init_(self.blocks)

    def forward_features(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise NotImplementedError("attention masks are not supported by SiameseNormVisionTransformer")
        x = self.patch_embed(x)
        x = self._pos_embed(x)
        x = self.patch_drop(x)
        x = self.norm_pre(x)
        state = init_streams(x, self.topology)
        for block in self.blocks:
            if self.grad_checkpointing and self.training and not torch.jit.is_scripting():
                state = checkpoint(block, state, use_reentrant=False)
            else:
                state = block(state)
        return self.norm(state)

    def forward_intermediates(self, *args, **kwargs):
        raise NotImplementedError("forward_intermediates is not implemented for two-stream models; use forward_features")

    @staticmethod
    def convert_state_dict(state_dict: dict, model: Optional[nn.Module] = None) -> dict:
        return convert_deit_state_dict(state_dict, model)


# Public SiameseNorm DeiT file -> ours. Its top-level `pre_norm` is applied to X and `post_norm` to Y
# (docs/models.md, "Weights in and out"), so they map to our `norm.norm_x` / `norm.norm_y` respectively.
_PUBLIC_SIAMESE_DEIT_TOP = {"pre_norm.": "norm.norm_x.", "post_norm.": "norm.norm_y.", "final_norm.": "norm.norm_out."}


def convert_deit_state_dict(state_dict: dict, model: Optional[nn.Module] = None) -> dict:
    """Convert public DeiT layouts (timm / facebookresearch DeiT, public SiameseNorm DeiT) to ours.

    timm's Pre-Norm keys are already ours; the public SiameseNorm file differs only in the
    top-level fusion norms. Distillation tokens/heads are rejected with a clear message.
    """
    if any(k.startswith(("dist_token", "head_dist")) for k in state_dict):
        raise ValueError("this is a distilled DeiT checkpoint (dist_token/head_dist); use timm's "
                         "deit_*_distilled_patch16_224 models for it")
    if "final_norm.weight" in state_dict:
        return convert_state_dict(state_dict, prefix_map=_PUBLIC_SIAMESE_DEIT_TOP)
    return dict(state_dict)


def _cfg(**kwargs):
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
        **kwargs,
    }


_SIZES = {
    "tiny": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "small": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "base": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
}
_TOPOLOGIES = ("siamese", "post", "mixln", "residual", "sandwich", "deepnorm", "layerscale", "dyt")

default_cfgs = generate_default_cfgs(
    {f"deit_{size}_{topo}_patch16_224": _cfg() for size in _SIZES for topo in _TOPOLOGIES}
)


def _create(variant: str, pretrained: bool = False, **kwargs) -> SiameseNormVisionTransformer:
    return build_model_with_cfg(
        SiameseNormVisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=convert_deit_state_dict,
        feature_cfg=dict(out_indices=3, feature_cls="getter"),
        **kwargs,
    )


def _register(size: str, topology: str):
    name = f"deit_{size}_{topology}_patch16_224"

    def factory(pretrained: bool = False, **kwargs) -> SiameseNormVisionTransformer:
        return _create(name, pretrained, **{**_SIZES[size], "topology": topology, **kwargs})

    factory.__name__ = name
    factory.__qualname__ = name
    factory.__doc__ = f"DeiT-{size} ({_SIZES[size]['embed_dim']} wide) with {topology} residual topology, 224px, patch 16."
    factory.__module__ = __name__
    globals()[name] = register_model(factory)


for _size in _SIZES:
    for _topo in _TOPOLOGIES:
        _register(_size, _topo)
