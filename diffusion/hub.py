"""A DiT in the Hugging Face stack: shared with its description, exported to diffusers, sampled by a pipeline.

* :class:`DiTModel` is our DiT (any topology) as a diffusers ``ModelMixin`` + ``ConfigMixin``: ``save_pretrained``
  writes ``config.json`` (the :class:`~diffusion.spec.DiTSpec`) and ``diffusion_pytorch_model.safetensors`` (the
  DiT's own keys), ``from_pretrained`` reads a folder or a Hub repository, ``push_to_hub`` shares it.
* :func:`to_diffusers_transformer` turns a Pre-Norm DiT into diffusers' ``DiTTransformer2DModel`` (the published
  architecture, which diffusers implements); :func:`exact_timesteps` makes its timestep features DiT's.
* :class:`diffusion.pipeline.DiTSamplingPipeline` samples either with the learned variance.

    model, spec, _ = load_dit("runs/dit_b2_siamese/ema.safetensors")
    DiTModel.from_dit(model, spec).save_pretrained("dit_b2_siamese")          # or .push_to_hub("user/dit_b2_siamese")
    same = DiTModel.from_pretrained("dit_b2_siamese")
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from diffusers import ConfigMixin, DiTTransformer2DModel, ModelMixin
from diffusers.configuration_utils import register_to_config
from timm.layers import GluMlp

from diffusion.models import DiT
from diffusion.spec import DiTSpec

Tensor = torch.Tensor


class DiTModel(DiT, ModelMixin, ConfigMixin):
    """:class:`~diffusion.models.DiT` under diffusers' ``from_pretrained`` / ``save_pretrained`` / ``push_to_hub``.

    The config is the model's :class:`~diffusion.spec.DiTSpec` (``model_kwargs`` is its ``kwargs``: diffusers
    drops a config key named ``kwargs``); the state dict is the DiT's, so its weights load anywhere a DiT's do.
    """

    config_name = "config.json"

    @register_to_config
    def __init__(self, name: str, topology: str, learn_sigma: bool, class_dropout_prob: float, in_channels: int,
                 input_size: int, num_classes: int, autoencoder: str, num_timesteps: int, beta_start: float,
                 beta_end: float, model_kwargs: Optional[Dict[str, Any]] = None, vae_sha256: Optional[str] = None,
                 vae_scaling_factor: Optional[float] = None, class_names: Optional[List[str]] = None,
                 transport: Optional[Dict[str, Any]] = None, latent_norm: Optional[Dict[str, Any]] = None):
        spec = DiTSpec(name=name, topology=topology, learn_sigma=learn_sigma, class_dropout_prob=class_dropout_prob,
                       in_channels=in_channels, input_size=input_size, num_classes=num_classes,
                       autoencoder=autoencoder, num_timesteps=num_timesteps, beta_start=beta_start,
                       beta_end=beta_end, kwargs=dict(model_kwargs or {}), vae_sha256=vae_sha256,
                       vae_scaling_factor=vae_scaling_factor, class_names=class_names, transport=transport,
                       latent_norm=latent_norm)
        super().__init__(**spec.dit_kwargs())
        self.spec = spec

    @classmethod
    def from_spec(cls, spec: DiTSpec) -> "DiTModel":
        fields = {k: v for k, v in vars(spec).items() if k != "kwargs"}
        return cls(**fields, model_kwargs=spec.kwargs)

    @classmethod
    def from_dit(cls, model: DiT, spec: DiTSpec) -> "DiTModel":
        """The same network and weights, shareable."""
        shared = cls.from_spec(spec)
        shared.load_state_dict(model.state_dict())
        return shared.eval()


# ------------------------------------------------------------------------------------ diffusers' DiT

def exact_timesteps(transformer: DiTTransformer2DModel) -> DiTTransformer2DModel:
    """Give diffusers' DiT the official DiT's timestep features, in place.

    Both compute ``[cos(t f_k), sin(t f_k)]`` over 128 frequencies ``f_k = 10000^(-k / d)``; DiT divides by
    ``d = 128``, diffusers' ``Timesteps(downscale_freq_shift=1)`` by ``d = 127``, and its config cannot say
    otherwise. Every converted DiT (facebook/DiT-XL-2-256 too) was trained with ``d = 128``.
    """
    for block in transformer.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
    return transformer


def backbone_switches(model: DiT) -> List[str]:
    """The backbone switches a DiT has on (LightningDiT's, :class:`diffusion.models.DiTBlock`), none for the
    published DiT."""
    block = model.blocks[0]
    found = {"norm=rmsnorm": isinstance(model.final_layer.norm_final, torch.nn.RMSNorm),
             "mlp=swiglu": isinstance(block.mlp, GluMlp), "rope": model.rope is not None,
             "qk_norm": not isinstance(block.attn.q_norm, torch.nn.Identity), "wo_shift": block.modulations == 4}
    return [name for name, on in found.items() if on]


def to_diffusers_transformer(model: DiT) -> DiTTransformer2DModel:
    """A Pre-Norm DiT with DiT's own backbone as diffusers' ``DiTTransformer2DModel``, same weights, outputs equal
    after :func:`exact_timesteps` (applied here; a folder it is saved to loads with diffusers' own projection).

    diffusers keeps a copy of the timestep and label embedders in every block (its final layer reads block 0's),
    splits the fused ``qkv`` projection and always holds a null-class row in the label table (a zero row is added
    for a model trained without label dropout).
    """
    if model.topology != "pre" or backbone_switches(model):
        switches = ", ".join(backbone_switches(model))
        what = f"a {model.topology!r} DiT" if model.topology != "pre" else f"a DiT with {switches}"
        raise ValueError(f"diffusers' DiTTransformer2DModel is the published Pre-Norm DiT; {what} is shared as "
                         "DiTModel (python -m diffusion.export --format hub)")
    hidden, heads = model.pos_embed.shape[-1], model.blocks[0].attn.num_heads
    transformer = DiTTransformer2DModel(
        num_attention_heads=heads, attention_head_dim=hidden // heads, in_channels=model.in_channels,
        out_channels=model.out_channels, num_layers=len(model.blocks), sample_size=model.input_size,
        patch_size=model.patch_size, activation_fn="gelu-approximate", num_embeds_ada_norm=model.num_classes,
        norm_type="ada_norm_zero", norm_elementwise_affine=False, norm_eps=1e-6)
    ours = model.state_dict()
    table = ours["y_embedder.embedding_table.weight"]
    if len(table) == model.num_classes:
        table = torch.cat([table, table.new_zeros(1, table.shape[1])])
    theirs = {"pos_embed.proj.weight": ours["x_embedder.proj.weight"], "pos_embed.proj.bias": ours["x_embedder.proj.bias"],
              "proj_out_1.weight": ours["final_layer.adaLN_modulation.1.weight"],
              "proj_out_1.bias": ours["final_layer.adaLN_modulation.1.bias"],
              "proj_out_2.weight": ours["final_layer.linear.weight"], "proj_out_2.bias": ours["final_layer.linear.bias"]}
    for i in range(len(model.blocks)):
        block, emb = f"blocks.{i}.", f"transformer_blocks.{i}.norm1.emb."
        q, k, v = ours[block + "attn.qkv.weight"].chunk(3)
        qb, kb, vb = ours[block + "attn.qkv.bias"].chunk(3)
        theirs.update({
            emb + "timestep_embedder.linear_1.weight": ours["t_embedder.mlp.0.weight"],
            emb + "timestep_embedder.linear_1.bias": ours["t_embedder.mlp.0.bias"],
            emb + "timestep_embedder.linear_2.weight": ours["t_embedder.mlp.2.weight"],
            emb + "timestep_embedder.linear_2.bias": ours["t_embedder.mlp.2.bias"],
            emb + "class_embedder.embedding_table.weight": table,
            f"transformer_blocks.{i}.norm1.linear.weight": ours[block + "adaLN_modulation.1.weight"],
            f"transformer_blocks.{i}.norm1.linear.bias": ours[block + "adaLN_modulation.1.bias"],
            f"transformer_blocks.{i}.attn1.to_q.weight": q, f"transformer_blocks.{i}.attn1.to_q.bias": qb,
            f"transformer_blocks.{i}.attn1.to_k.weight": k, f"transformer_blocks.{i}.attn1.to_k.bias": kb,
            f"transformer_blocks.{i}.attn1.to_v.weight": v, f"transformer_blocks.{i}.attn1.to_v.bias": vb,
            f"transformer_blocks.{i}.attn1.to_out.0.weight": ours[block + "attn.proj.weight"],
            f"transformer_blocks.{i}.attn1.to_out.0.bias": ours[block + "attn.proj.bias"],
            f"transformer_blocks.{i}.ff.net.0.proj.weight": ours[block + "mlp.fc1.weight"],
            f"transformer_blocks.{i}.ff.net.0.proj.bias": ours[block + "mlp.fc1.bias"],
            f"transformer_blocks.{i}.ff.net.2.weight": ours[block + "mlp.fc2.weight"],
            f"transformer_blocks.{i}.ff.net.2.bias": ours[block + "mlp.fc2.bias"],
        })
    expected = transformer.state_dict()
    if "pos_embed.pos_embed" in expected:  # diffusers' own sin-cos table: the same values as ours
        theirs["pos_embed.pos_embed"] = ours["pos_embed"]
    transformer.load_state_dict(theirs, strict=True)
    return exact_timesteps(transformer.eval())
