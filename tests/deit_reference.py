"""An independent, functional re-statement of docs/method.md sections 1-2 for the tests.

Plain tensor ops over a state dict in the *public SiameseNorm DeiT layout* (docs/method.md section 2):
per block ``pre_norm{i}, post_norm{i}, input_norm{i}, attn.{qkv,proj}, mlp.{fc1,fc2}``; top level
``cls_token, pos_embed, patch_embed.proj, pre_norm`` (applied to X), ``post_norm`` (applied to Y),
``final_norm, head``. Nothing here imports the project's model code.
"""
import math

import torch
import torch.nn.functional as F

EPS = 1e-6


def _ln(sd, name, x):
    return F.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], eps=EPS)


def _linear(sd, name, x):
    return x @ sd[f"{name}.weight"].t() + sd[f"{name}.bias"]


def _attention(sd, prefix, x, num_heads):
    b, n, d = x.shape
    qkv = _linear(sd, f"{prefix}.qkv", x).reshape(b, n, 3, num_heads, d // num_heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // num_heads), dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(b, n, d)
    return _linear(sd, f"{prefix}.proj", out)


def _mlp(sd, prefix, x):
    h = _linear(sd, f"{prefix}.fc1", x)
    h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    return _linear(sd, f"{prefix}.fc2", h)


def embed(sd, images, patch_size):
    x = F.conv2d(images, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=patch_size)
    x = x.flatten(2).transpose(1, 2)
    cls = sd["cls_token"].expand(x.shape[0], -1, -1)
    return torch.cat([cls, x], dim=1) + sd["pos_embed"]


def siamese_deit_forward(sd, images, *, depth, num_heads, patch_size, normalized_input=True, depth_scaling=True):
    """Logits of a SiameseNorm DeiT given its weights in the public layout."""
    x = y = embed(sd, images, patch_size)
    for l in range(depth):
        c = math.sqrt(2 * (l + 1)) if depth_scaling else 1.0
        p = f"blocks.{l}"
        for i, sublayer in ((1, lambda h: _attention(sd, f"{p}.attn", h, num_heads)), (2, lambda h: _mlp(sd, f"{p}.mlp", h))):
            x = _ln(sd, f"{p}.post_norm{i}", x)
            u = x + _ln(sd, f"{p}.pre_norm{i}", y)
            if normalized_input:
                u = _ln(sd, f"{p}.input_norm{i}", u)
            z = sublayer(u)
            x = x + z / c
            y = y + z
    h = _ln(sd, "final_norm", _ln(sd, "pre_norm", x) + _ln(sd, "post_norm", y))
    return _linear(sd, "head", h[:, 0])


def public_siamese_deit_names(depth, normalized_input=True):
    """Parameter names of the public SiameseNorm DeiT file (docs/method.md section 2), without shapes."""
    names = ["cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"]
    for l in range(depth):
        for i in (1, 2):
            norms = ["pre_norm", "post_norm"] + (["input_norm"] if normalized_input else [])
            for n in norms:
                names += [f"blocks.{l}.{n}{i}.weight", f"blocks.{l}.{n}{i}.bias"]
        for lin in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"):
            names += [f"blocks.{l}.{lin}.weight", f"blocks.{l}.{lin}.bias"]
    for n in ("pre_norm", "post_norm", "final_norm", "head"):
        names += [f"{n}.weight", f"{n}.bias"]
    return names


def public_siamese_deit_state_dict(*, depth, dim, num_heads, patch_size, img_size, num_classes, in_chans=3, seed=0,
                                   normalized_input=True):
    """A random state dict in the public layout, with shapes from the ViT definition (not from our model)."""
    g = torch.Generator().manual_seed(seed)
    tokens = (img_size // patch_size) ** 2 + 1
    shapes = {
        "cls_token": (1, 1, dim),
        "pos_embed": (1, tokens, dim),
        "patch_embed.proj.weight": (dim, in_chans, patch_size, patch_size),
        "patch_embed.proj.bias": (dim,),
        "head.weight": (num_classes, dim),
        "head.bias": (num_classes,),
    }
    lin = {"attn.qkv": (3 * dim, dim), "attn.proj": (dim, dim), "mlp.fc1": (4 * dim, dim), "mlp.fc2": (dim, 4 * dim)}
    sd = {}
    for name in public_siamese_deit_names(depth, normalized_input):
        if name in shapes:
            shape = shapes[name]
        else:
            module, kind = name.rsplit(".", 1)
            key = module.split(".", 2)[-1] if module.startswith("blocks.") else module
            if key in lin:
                shape = lin[key] if kind == "weight" else (lin[key][0],)
            else:  # a LayerNorm
                shape = (dim,)
        if "norm" in name and name.endswith("weight"):
            sd[name] = 1.0 + 0.2 * torch.randn(shape, generator=g)
        else:
            sd[name] = 0.1 * torch.randn(shape, generator=g)
    return sd


def _dyt(sd, name, x):
    return torch.tanh(sd[f"{name}.alpha"] * x) * sd[f"{name}.weight"] + sd[f"{name}.bias"]


def baseline_deit_forward(sd, images, topology, *, depth, num_heads, patch_size):
    """Logits of the baseline topologies, restated from their papers, over our state-dict names.

    pre: Y + F(LN Y); post: LN(X + F X); sandwich (Peri-LN): Y + LN_out(F(LN Y));
    deepnorm: LN(alpha X + F X), alpha = (2N)^(1/4); layerscale: Y + gamma * F(LN Y);
    dyt: Pre-Norm with tanh(alpha x) * w + b for every LayerNorm;
    residual (ResiDual): Z = F(X), X <- LN(X + Z), Y <- Y + Z, output X + LN(Y).
    """
    norm = _dyt if topology == "dyt" else _ln
    x = y = embed(sd, images, patch_size)
    alpha = (2 * depth) ** 0.25
    for l in range(depth):
        p = f"blocks.{l}"
        for i, sublayer in ((1, lambda h: _attention(sd, f"{p}.attn", h, num_heads)), (2, lambda h: _mlp(sd, f"{p}.mlp", h))):
            if topology in ("pre", "dyt"):
                y = y + sublayer(norm(sd, f"{p}.norm{i}", y))
            elif topology == "layerscale":
                y = y + sd[f"{p}.ls{i}.gamma"] * sublayer(_ln(sd, f"{p}.norm{i}", y))
            elif topology == "sandwich":
                y = y + _ln(sd, f"{p}.out_norm{i}", sublayer(_ln(sd, f"{p}.norm{i}", y)))
            elif topology == "post":
                y = _ln(sd, f"{p}.norm{i}", y + sublayer(y))
            elif topology == "deepnorm":
                y = _ln(sd, f"{p}.norm{i}", alpha * y + sublayer(y))
            elif topology == "residual":
                z = sublayer(x)
                x, y = _ln(sd, f"{p}.norm{i}", x + z), y + z
            else:
                raise ValueError(topology)
    if topology == "residual":
        h = x + _ln(sd, "norm.norm_y", y)
    elif topology in ("post", "deepnorm"):
        h = y
    else:
        h = norm(sd, "norm", y)
    return _linear(sd, "head", h[:, 0])
