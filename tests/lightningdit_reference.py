"""LightningDiT's forward (hustvl/LightningDiT, ``models/lightningdit.py``) restated on plain tensors from a state dict
in LightningDiT's own key layout: the tests load such a state dict into our Pre-Norm DiT with the backbone switches
and compare. Written from LightningDiT's code (its Attention, SwiGLUFFN, RMSNorm, VisionRotaryEmbeddingFast,
LightningDiTBlock, FinalLayer), none of it taken from ours."""
import math

import torch
import torch.nn.functional as F


def rms(x, weight, eps=1e-6):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def rope_tables(head_dim, grid):
    """EVA's VisionRotaryEmbeddingFast(dim=head_dim // 2, pt_seq_len=grid): ``(cos, sin)``, ``(grid^2, head_dim)``."""
    dim = head_dim // 2
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(grid) / grid * grid
    f = torch.einsum("i,f->if", t, freqs).repeat_interleave(2, -1)                     # (grid, dim), pairs (d r)
    f = torch.cat([f[:, None, :].expand(grid, grid, dim), f[None, :, :].expand(grid, grid, dim)], -1)
    f = f.reshape(grid * grid, head_dim)
    return f.cos(), f.sin()


def rotate_half(x):
    x = x.reshape(*x.shape[:-1], -1, 2)
    return torch.stack((-x[..., 1], x[..., 0]), -1).flatten(-2)


def timestep_embedding(t, dim=256, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


def linear(sd, name, x):
    return F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))


def lightningdit_forward(sd, x, t, y, *, num_heads, patch_size, use_qknorm=False, use_swiglu=False, use_rope=False,
                         use_rmsnorm=False, wo_shift=False, learn_sigma=False):
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    p = patch_size
    h = F.conv2d(x, sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"], stride=p).flatten(2).transpose(1, 2)
    h = h + sd["pos_embed"]
    B, N, D = h.shape
    hd = D // num_heads
    temb = linear(sd, "t_embedder.mlp.2", F.silu(linear(sd, "t_embedder.mlp.0", timestep_embedding(t))))
    c = temb + sd["y_embedder.embedding_table.weight"][y]                                # eval: no label dropout
    cos, sin = rope_tables(hd, int(math.isqrt(N))) if use_rope else (None, None)

    def norm(prefix, v):
        if use_rmsnorm:
            return rms(v, sd[f"{prefix}.weight"])
        return F.layer_norm(v, (v.shape[-1],), eps=1e-6)

    def qk_norm(prefix, v):  # LightningDiT's Attention: RMSNorm with use_rmsnorm, else nn.LayerNorm(head_dim)
        if not use_qknorm:
            return v
        if use_rmsnorm:
            return rms(v, sd[f"{prefix}.weight"])
        return F.layer_norm(v, (hd,), sd[f"{prefix}.weight"], sd[f"{prefix}.bias"], eps=1e-5)

    def modulate(v, shift, scale):
        v = v * (1 + scale.unsqueeze(1))
        return v if shift is None else v + shift.unsqueeze(1)

    for i in range(depth):
        b = f"blocks.{i}"
        mod = linear(sd, f"{b}.adaLN_modulation.1", F.silu(c))
        if wo_shift:
            scale_msa, gate_msa, scale_mlp, gate_mlp = mod.chunk(4, dim=1)
            shift_msa = shift_mlp = None
        else:
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.chunk(6, dim=1)
        a = modulate(norm(f"{b}.norm1", h), shift_msa, scale_msa)
        qkv = linear(sd, f"{b}.attn.qkv", a).reshape(B, N, 3, num_heads, hd).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = qk_norm(f"{b}.attn.q_norm", q), qk_norm(f"{b}.attn.k_norm", k)
        if use_rope:
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D)
        h = h + gate_msa.unsqueeze(1) * linear(sd, f"{b}.attn.proj", a)
        m = modulate(norm(f"{b}.norm2", h), shift_mlp, scale_mlp)
        if use_swiglu:
            x1, x2 = linear(sd, f"{b}.mlp.w12", m).chunk(2, dim=-1)
            m = linear(sd, f"{b}.mlp.w3", F.silu(x1) * x2)
        else:
            m = linear(sd, f"{b}.mlp.fc2", F.gelu(linear(sd, f"{b}.mlp.fc1", m), approximate="tanh"))
        h = h + gate_mlp.unsqueeze(1) * m
    shift, scale = linear(sd, "final_layer.adaLN_modulation.1", F.silu(c)).chunk(2, dim=1)
    h = linear(sd, "final_layer.linear", modulate(norm("final_layer.norm_final", h), shift, scale))
    out_channels = h.shape[-1] // (p * p)
    g = int(math.isqrt(N))
    h = h.reshape(B, g, g, p, p, out_channels).permute(0, 5, 1, 3, 2, 4).reshape(B, out_channels, g * p, g * p)
    return h.chunk(2, dim=1)[0] if learn_sigma else h


def velocity_losses(model, x1, x0, t, y):
    """LightningDiT's transport.training_losses on the linear path (ICPlan: ``x_t = t x1 + (1 - t) x0``, target
    ``x1 - x0``) with ``use_cosine_loss``, and train.py's total ``cos_loss.mean() + loss.mean()``: ``(loss, cos_loss,
    total)``, the first two per sample."""
    t_b = t.view(-1, *([1] * (x1.ndim - 1)))
    xt, ut = t_b * x1 + (1 - t_b) * x0, x1 - x0
    out = model(xt, t, y)
    loss = ((out - ut) ** 2).mean(dim=list(range(1, x1.ndim)))
    cos_loss = (1 - F.cosine_similarity(out, ut, dim=1)).mean(dim=list(range(1, x1.ndim - 1)))
    return loss, cos_loss, cos_loss.mean() + loss.mean()
