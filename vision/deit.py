"""DeiT with a switchable residual topology (Pre-Norm, Post-Norm, Mix-LN, SiameseNorm, ...), registered with timm.

The model is timm's :class:`~timm.models.vision_transformer.VisionTransformer` (patch embedding, position
embedding, class token, pooling, head, weight init, pretrained loading, feature extraction) with its blocks
replaced by :class:`DeiTBlock` (timm's attention and MLP) on a residual topology of :mod:`common.topologies`.

After ``import vision`` the names in :data:`MODEL_NAMES` exist in timm's registry::

    deit_{tiny,small,base}_{siamese,post,mixln,residual,sandwich,deepnorm,layerscale,dyt,hc,mhc,attnres,
                            attnres_block}_patch16_224
    deit_{tiny,small,base}_{same topologies}_distilled_patch16_224      (DeiT's distillation token and head)
    deit3_{small,base}_{same topologies but layerscale}_patch16_224      (DeiT III's LayerScale models)

Pre-Norm DeiT stays timm's own ``deit_*_patch16_224`` / ``deit_*_distilled_patch16_224`` / ``deit3_*_patch16_224``;
``topology="pre"`` here builds the same network with the same state-dict keys.
"""

from __future__ import annotations

import inspect
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import timm
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import Attention, LayerNorm, LayerScale, Mlp, get_norm_layer
from timm.models import (build_model_with_cfg, generate_default_cfgs, model_entrypoint, register_model,
                         register_notrace_function)
from timm.models._features import feature_take_indices
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from common.checkpoint import CheckpointError, convert_state_dict, load_weights, read_file, unwrap_state_dict
from common.cli import InputError, InputNotFoundError
from common.config import ConfigError, did_you_mean
from common.topologies import (
    ResidualBlock,
    StreamFusion,
    TopologyPlan,
    option_names,
    readout,
    resolve_topology,
    topology_names,
)

Tensor = torch.Tensor


class DeiTBlock(ResidualBlock):
    """timm's ViT sublayers (fused SDPA attention, MLP, optional LayerScale) for a residual topology.

    ``F1(h) = ls1(attn(h, attn_mask))``, ``F2(h) = ls2(mlp(h))``. Takes the keyword arguments timm's
    ``VisionTransformer`` passes to ``block_fn``; ``depth`` is the 0-based block index (timm's name for it).
    Built on a topology by :meth:`common.topologies.TopologyPlan.build_block`; ``**topology_options`` go to the
    topology's block.
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
        depth: int = 0,
        device=None,
        dtype=None,
        **topology_options,
    ):
        dd = {"device": device, "dtype": dtype}
        super().__init__(dim, depth, norm_layer=partial(norm_layer, **dd), drop_path=drop_path, **topology_options)
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

    def sublayer1(self, h: Tensor, ctx: Optional[Tensor]) -> Tensor:
        return self.ls1(self.attn(h, attn_mask=ctx))

    def sublayer2(self, h: Tensor, ctx: Optional[Tensor]) -> Tensor:
        return self.ls2(self.mlp(h))


@torch.fx.wrap
@register_notrace_function
def attention_mask(x: Tensor, attn_mask: Optional[Tensor], is_causal: bool) -> Optional[Tensor]:
    """The mask every attention sublayer gets; ``is_causal`` becomes a boolean lower-triangular mask.

    A leaf for FX tracing (as timm's own mask helpers), since it branches on its arguments.
    """
    if not is_causal:
        return attn_mask
    if attn_mask is not None:
        raise ValueError("attn_mask and is_causal=True exclude each other, as in scaled_dot_product_attention")
    return torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()


def deit_block(*, depth: int, plan: TopologyPlan, **kwargs) -> ResidualBlock:
    """``block_fn`` for timm's ``VisionTransformer``: block ``depth`` (timm's name for the index) of ``plan``."""
    return plan.build_block(DeiTBlock, depth, depth=depth, **kwargs)


class SiameseNormVisionTransformer(VisionTransformer):
    """timm ViT/DeiT whose blocks use a switchable residual topology.

    For the two-stream topologies (SiameseNorm, ResiDual) the blocks pass on ``(X, Y)`` and ``norm`` is the
    output fusion (:meth:`common.topologies.TopologyPlan.output`) the head reads. The intermediates of
    :meth:`forward_intermediates` (and so ``features_only=True``) are :func:`common.topologies.readout` of the
    streams after each block: what the head would read if the network ended there.

    Args:
        topology: ``siamese`` (default), ``pre``, ``post``, ``mixln``, or another name of
            :func:`common.topologies.topology_names` (``deit``); docs/method.md says what each computes.
        **kwargs: the topology's options (``normalized_input``, ``depth_scaling``, ``recompute_norms``,
            ``mixln_post_blocks``, ``hc_streams``, ...: each topology's registration names its own and their
            defaults; an option of another topology is refused) and every ``VisionTransformer`` argument
            (``img_size``, ``patch_size``, ``embed_dim``, ``depth``, ``num_heads``, ``drop_path_rate``, ...).
    """

    def __init__(self, topology: str = "siamese", **kwargs):
        if kwargs.get("block_fn") is not None:
            raise ValueError("block_fn is set by SiameseNormVisionTransformer; choose a `topology` instead")
        options = {k: kwargs.pop(k) for k in option_names() if k in kwargs}
        plan = resolve_topology(topology, kwargs.get("depth", 12), "deit", **options)
        for key, value in plan.model_defaults().items():  # LayerScale's init_values, DyT's norm_layer
            kwargs[key] = kwargs.get(key) or value
        super().__init__(block_fn=partial(deit_block, plan=plan), **kwargs)
        self.topology = topology
        self.topology_plan = plan
        self.block_topologies = plan.block_topologies
        self.streams = plan.streams(self.embed_dim)
        # A ModuleList, not timm's Sequential: two-stream blocks take and return (X, Y), which TorchScript
        # cannot pass through Sequential.forward.
        self.blocks = nn.ModuleList(self.blocks)
        # timm builds `norm` as a LayerNorm (Identity when pooling uses fc_norm); the stream fusion takes its place.
        norm_layer = get_norm_layer(kwargs.get("norm_layer")) or LayerNorm
        self.norm = plan.output(self.embed_dim, partial(norm_layer, device=kwargs.get("device"),
                                                        dtype=kwargs.get("dtype")),
                                final_norm=not isinstance(self.norm, nn.Identity))
        plan.init_weights(self.blocks)
        if kwargs.get("device") is not None or kwargs.get("dtype") is not None:
            # timm's factory arguments reach timm's layers; the stream and source parameters of common.topologies follow
            self.to(device=kwargs.get("device"), dtype=kwargs.get("dtype"))

    def _embed(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)
        x = self._pos_embed(x)
        x = self.patch_drop(x)
        return self.norm_pre(x)

    def _initial_state(self, x: Tensor, attn_mask: Optional[Tensor], is_causal: bool):
        """The first block's state (the embedding in the streams the topology carries) and the attention mask."""
        tokens = self._embed(x)
        return self.streams(tokens), attention_mask(tokens, attn_mask, is_causal)

    def forward_features(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        """Embed, run the blocks, fuse the streams. ``attn_mask`` as SDPA takes it (boolean: True attends;
        float: added to the scores), broadcast over batch and heads."""
        state, attn_mask = self._initial_state(x, attn_mask, is_causal)
        for block in self.blocks:
            if self.grad_checkpointing and self.training and not torch.jit.is_scripting():
                state = checkpoint(block, state, attn_mask, use_reentrant=False)
            else:  # one argument without a mask, so a block replaced by nn.Identity (timm's idiom) still runs
                state = block(state) if attn_mask is None else block(state, attn_mask)
        return self.norm(state)

    def forward_intermediates(
        self,
        x: Tensor,
        indices: Optional[Union[int, List[int]]] = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
        attn_mask: Optional[Tensor] = None,
        is_causal: bool = False,
    ) -> Union[List[Tensor], Tuple[Tensor, List[Tensor]], Dict[str, object]]:
        """timm's ``forward_intermediates``: the features after the blocks in ``indices`` (the last ``n`` for an
        int, all for None), with timm's arguments and return forms.

        The intermediate of block ``l`` is :func:`common.topologies.readout` of its output state: the stream itself
        for single-stream topologies (through the final norm with ``norm=True``); for SiameseNorm the output
        fusion applied to ``(X_l, Y_l)``, ``LN_x(X_l) + LN_y(Y_l)``, and with ``norm=True`` ``LN_out`` of that,
        exactly what the head would read if the network ended at block ``l``; for ResiDual ``X_l + LN(Y_l)``
        (it has no final norm). The final features are :meth:`forward_features`' (of the last block run, with
        ``stop_early``).
        """
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be NCHW or NLC, got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        batch, _, height, width = x.shape
        state, attn_mask = self._initial_state(x, attn_mask, is_causal)
        intermediates = []
        for i, block in enumerate(self.blocks[: max_index + 1] if stop_early else self.blocks):
            if self.grad_checkpointing and self.training:
                state = checkpoint(block, state, attn_mask, use_reentrant=False)
            else:
                state = block(state) if attn_mask is None else block(state, attn_mask)
            if i in take_indices:
                intermediates.append(readout(self.norm, state, norm))

        prefix = [t[:, : self.num_prefix_tokens] for t in intermediates] if self.num_prefix_tokens else None
        intermediates = [t[:, self.num_prefix_tokens:] for t in intermediates]
        if output_fmt == "NCHW":
            h, w = self.patch_embed.dynamic_feat_size((height, width))
            intermediates = [t.reshape(batch, h, w, -1).permute(0, 3, 1, 2).contiguous() for t in intermediates]
        if output_dict:
            out = {"image_intermediates": intermediates}
            if prefix is not None and return_prefix_tokens:
                out["image_intermediates_prefix"] = prefix
            if not intermediates_only:
                out["image_features"] = readout(self.norm, state)
            return out
        if return_prefix_tokens and prefix is not None:
            intermediates = list(zip(intermediates, prefix))
        if intermediates_only:
            return intermediates
        return readout(self.norm, state), intermediates

    def prune_intermediate_layers(
        self, indices: Union[int, List[int]] = 1, prune_norm: bool = False, prune_head: bool = True,
    ) -> List[int]:
        """Drop the blocks after the last of ``indices``; ``prune_norm`` drops the final norm (SiameseNorm's
        ``LN_out``, so the features are the ``norm=False`` intermediate), ``prune_head`` the classifier."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max_index + 1]
        if prune_norm:
            if hasattr(self.norm, "norm_out"):
                self.norm.norm_out = nn.Identity()
            elif not isinstance(self.norm, StreamFusion):
                self.norm = nn.Identity()
        if prune_head:
            self.fc_norm = nn.Identity()
            self.reset_classifier(0, "")
        return take_indices

    @staticmethod
    def convert_state_dict(state_dict: dict, model: Optional[nn.Module] = None) -> dict:
        return convert_deit_state_dict(state_dict, model)


class SiameseNormVisionTransformerDistilled(SiameseNormVisionTransformer, VisionTransformerDistilled):
    """:class:`SiameseNormVisionTransformer` with DeiT's distillation token and head, as timm's
    ``deit_*_distilled_patch16_224`` (:class:`timm.models.deit.VisionTransformerDistilled`: ``dist_token``, a
    position embedding for two prefix tokens, ``head_dist``).

    The distillation token is a prefix token like the class token: it enters every stream the topology carries
    (SiameseNorm's ``X`` and ``Y`` both start from the embedded tokens) and is read after the output fusion, where
    ``head_dist`` classifies it. In training with ``set_distilled_training(True)`` the model returns
    ``(head logits, head_dist logits)``; otherwise (evaluation) their average, as DeiT evaluates.
    """


# Public SiameseNorm DeiT file -> ours. Its top-level `pre_norm` is applied to X and `post_norm` to Y
# (docs/models.md, "Weights in and out"), so they map to our `norm.norm_x` / `norm.norm_y` respectively.
_PUBLIC_SIAMESE_DEIT_TOP = {"pre_norm.": "norm.norm_x.", "post_norm.": "norm.norm_y.", "final_norm.": "norm.norm_out."}


def convert_deit_state_dict(state_dict: dict, model: Optional[nn.Module] = None) -> dict:
    """Convert public DeiT layouts (timm / facebookresearch DeiT, public SiameseNorm DeiT) to ours.

    timm's Pre-Norm keys are already ours (with ``dist_token``/``head_dist`` for the distilled models); the public
    SiameseNorm file differs only in the top-level fusion norms. A distilled file for a model without the
    distillation head is refused with the model to use.
    """
    distilled_model = model is None or isinstance(model, VisionTransformerDistilled)
    if not distilled_model and any(k.startswith(("dist_token", "head_dist")) for k in state_dict):
        raise ValueError("this is a distilled DeiT checkpoint (dist_token/head_dist); load it into a "
                         "deit_*_distilled_patch16_224 model (ours: deit_<size>_<topology>_distilled_patch16_224)")
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
MODEL_TOPOLOGIES = topology_names("deit")
_TOPOLOGIES = tuple(t for t in MODEL_TOPOLOGIES if t != "pre")  # Pre-Norm DeiT is timm's own deit_*_patch16_224

# DeiT III's models (timm's deit3_*): LayerScale in both sublayers, a position embedding of the patches alone (the
# class token joins after it). Every topology but `layerscale`, which each of them already is.
_DEIT3 = dict(no_embed_class=True, init_values=1e-6)
_DEIT3_SIZES = ("small", "base")
_DEIT3_TOPOLOGIES = tuple(t for t in _TOPOLOGIES if t != "layerscale")

MODEL_NAMES = tuple(f"deit_{size}_{topology}{distilled}_patch16_224" for distilled in ("", "_distilled")
                    for size in _SIZES for topology in _TOPOLOGIES) + tuple(
    f"deit3_{size}_{topology}_patch16_224" for size in _DEIT3_SIZES for topology in _DEIT3_TOPOLOGIES)
default_cfgs = generate_default_cfgs({name: _cfg(classifier=("head", "head_dist") if "_distilled" in name else "head")
                                      for name in MODEL_NAMES})


def _create(variant: str, pretrained: bool = False, **kwargs) -> SiameseNormVisionTransformer:
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        SiameseNormVisionTransformerDistilled if "_distilled" in variant else SiameseNormVisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=convert_deit_state_dict,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )


_REGISTERED: Dict[str, Dict] = {}  # name -> its size's and topology's constructor arguments


def _register(size: str, topology: str, distilled: str, family: str = "deit"):
    name = f"{family}_{size}_{topology}{distilled}_patch16_224"
    arguments = {**_SIZES[size], **(_DEIT3 if family == "deit3" else {}), "topology": topology}
    _REGISTERED[name] = arguments

    def factory(pretrained: bool = False, **kwargs) -> SiameseNormVisionTransformer:
        return _create(name, pretrained, **{**arguments, **kwargs})

    factory.__name__ = name
    factory.__qualname__ = name
    factory.__doc__ = (f"{'DeiT III' if family == 'deit3' else 'DeiT'}-{size} ({_SIZES[size]['embed_dim']} wide) with "
                       f"{topology} residual topology, 224px, patch 16"
                       f"{', distillation token and head' if distilled else ''}"
                       f"{', LayerScale (init 1e-6) in both sublayers' if family == 'deit3' else ''}.")
    factory.__module__ = __name__
    globals()[name] = register_model(factory)


for _distilled in ("", "_distilled"):
    for _size in _SIZES:
        for _topo in _TOPOLOGIES:
            _register(_size, _topo, _distilled)
for _size in _DEIT3_SIZES:
    for _topo in _DEIT3_TOPOLOGIES:
        _register(_size, _topo, "", family="deit3")


# ------------------------------------------------------------------- building the model a config names

def check_model_name(name: str, kwargs: dict) -> None:
    """``model.name`` must be a timm model (ours registered) and ``model.kwargs`` its arguments: a config error
    before any work, not a silently ignored setting. The schema itself is :class:`vision.config.ModelConfig`."""
    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:12]
        raise ConfigError(f"unknown model {name!r}{did_you_mean(name, timm.list_models())}; e.g. "
                          f"{', '.join(close) or 'see timm.list_models()'}. Ours: "
                          "deit_{tiny,small,base}_{siamese,post,mixln,...}_patch16_224 (Pre-Norm: timm's "
                          "deit_*_patch16_224)")
    check_model_kwargs(name, kwargs)


def build_model(model, data) -> nn.Module:
    """Create the timm model a config's ``model`` and ``data`` sections name (a :class:`vision.config.ModelConfig`
    and :class:`~vision.config.DataConfig`; name and keyword arguments were checked when the config loaded)."""
    kwargs = dict(model.kwargs)
    kwargs.setdefault("img_size", data.input_size)
    if model.pretrained:
        check_pretrained_reachable(model.name)
    try:
        return timm.create_model(model.name, pretrained=model.pretrained, num_classes=data.num_classes,
                                 drop_path_rate=model.drop_path, **kwargs)
    except TypeError as err:
        if "unexpected keyword argument" in str(err):
            raise ConfigError(f"model.kwargs do not fit {model.name}: {err}") from None
        raise


def load_finetune(model: nn.Module, path: Union[str, Path]) -> List[str]:
    """DeiT's ``--finetune``: start a ViT/DeiT from weights trained at another resolution or for another class count.

    The position embedding (and a patch embedding of another patch size) is resampled to the model's grid by timm's
    ViT ``checkpoint_filter_fn`` (bicubic, antialiased), as timm's pretrained loading does; a head whose class count
    differs keeps its fresh initialisation, as DeiT's main.py resets it. Every other key must match. Returns the
    reset keys.
    """
    state = checkpoint_filter_fn(unwrap_state_dict(read_file(path)), model, adapt_layer_scale=True)
    own = model.state_dict()
    reset = [k for k in ("head.weight", "head.bias", "head_dist.weight", "head_dist.bias")
             if k in state and k in own and state[k].shape != own[k].shape]
    for k in reset:
        del state[k]
    missing, unexpected = load_weights(model, state, strict=False)
    if sorted(missing) != sorted(reset) or unexpected:
        raise CheckpointError(f"{path} does not fit {type(model).__name__} beyond its resolution and class count: "
                              f"missing {sorted(set(missing) - set(reset))}, unexpected {sorted(unexpected)}; check "
                              "model.name and model.kwargs (topology, sizes)")
    return reset


def check_pretrained_reachable(name: str, timeout: float = 3.0) -> None:
    """Fail in seconds, not after a minute of retries, when timm's weights are neither cached nor downloadable."""
    import socket

    from huggingface_hub import try_to_load_from_cache

    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or not (cfg.hf_hub_id or cfg.url):
        raise InputError(f"{name} has no pretrained weights in timm; pass checkpoint=FILE instead of model.pretrained=true")
    if cfg.hf_hub_id and any(isinstance(try_to_load_from_cache(cfg.hf_hub_id, f), str)
                             for f in ("model.safetensors", "pytorch_model.bin", cfg.hf_hub_filename or "model.safetensors")):
        return
    if cfg.url and (Path(torch.hub.get_dir()) / "checkpoints" / Path(cfg.url).name).is_file():
        return
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
    except OSError:
        raise InputNotFoundError(f"the pretrained weights of {name} are not cached and huggingface.co cannot be "
                                 "reached: pass the weights file with checkpoint=FILE (and model.pretrained=false)") from None


def check_model_kwargs(name: str, kwargs: dict) -> None:
    """Unknown keyword arguments of a ViT/DeiT are an error before any work (not a silently ignored setting)."""
    module = model_entrypoint(name).__module__
    if module not in ("timm.models.vision_transformer", "timm.models.deit", SiameseNormVisionTransformer.__module__):
        return  # another timm family: timm's own TypeError is reported by build_model
    valid = set(inspect.signature(VisionTransformer).parameters)
    ours = name in _REGISTERED
    if ours:
        valid |= {"topology", *option_names()}
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        raise ConfigError(f"model.kwargs {unknown} are not arguments of {name}; valid ones include "
                          f"{', '.join(sorted(valid - {'kwargs'}))}")
    if ours:  # the topology's own options, for the depth the model gets
        arguments = {**_REGISTERED[name], **kwargs}
        options = {k: arguments[k] for k in option_names() if k in arguments}
        try:
            resolve_topology(arguments["topology"], arguments["depth"], "deit", **options)
        except InputError as err:
            raise ConfigError(f"model.kwargs: {err}") from None
