"""diffusion.models: the DiT family in Pre/Post/Mix-LN/Siamese topologies against independent references."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from common.checkpoint import CheckpointError, load_weights
from diffusion.models import DIT_TOPOLOGIES, DiT, DiT_models, sincos_pos_embed_2d

SMALL = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=3, num_heads=4, num_classes=10)


def small(topology="siamese", **kw):
    torch.manual_seed(0)
    return DiT(**{**SMALL, "topology": topology, **kw}).eval()


def randomize_(model, std=0.1, seed=1):
    """Move every trainable weight off its init (adaLN-Zero would otherwise make all outputs zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(std * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture
def inputs():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 4, 8, 8, generator=gen)
    t = torch.tensor([0, 17, 500, 999])
    y = torch.tensor([0, 3, 9, 10])  # 10 = the null class
    return x, t, y


@pytest.mark.parametrize("topology", DIT_TOPOLOGIES)
def test_torch_export_equals_eager(topology, inputs):
    """Every topology exports whole with torch.export, guidance's null label included, and gives eager's output."""
    model = randomize_(small(topology))
    with torch.no_grad():
        exported = torch.export.export(model, inputs)
        torch.testing.assert_close(exported.module()(*inputs), model(*inputs), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- sizes and FLOPs


def meta_model(name, topology="pre"):
    with torch.device("meta"):
        return DiT_models[name](topology=topology)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,expected,tol", [("DiT-B/2", 130.5e6, 0.1e6), ("DiT-L/4", 458e6, 1e6)])
def test_param_counts_and_exact_topology_overheads(name, expected, tol):
    pre, siamese, post = (meta_model(name, t) for t in ("pre", "siamese", "post"))
    assert abs(n_params(pre) - expected) <= tol, n_params(pre)
    depth, dim = len(pre.blocks), pre.pos_embed.shape[-1]
    # Siamese: 4 affine LayerNorms per block (pre/post x attn/mlp) + 2 in the final fusion, 2*dim each.
    assert n_params(siamese) - n_params(pre) == depth * 4 * 2 * dim + 2 * 2 * dim
    # Post-Norm: the two block norms become affine.
    assert n_params(post) - n_params(pre) == depth * 2 * 2 * dim


def test_registry_covers_the_family():
    assert sorted(DiT_models) == sorted([f"DiT-{s}/{p}" for s in ("S", "B", "L", "XL") for p in (2, 4, 8)]
                                        + [f"LightningDiT-{s}/{p}" for s in ("B", "L", "XL", "1p0B", "1p6B")
                                           for p in (1, 2)])
    xl = meta_model("DiT-XL/2")
    assert (len(xl.blocks), xl.pos_embed.shape[-1], xl.blocks[0].attn.num_heads) == (28, 1152, 16)
    assert abs(n_params(xl) - 675.13e6) < 0.1e6  # the DiT paper's 675M


def forward_flops(model):
    x, t, y = torch.randn(1, 4, 32, 32, device="meta"), torch.zeros(1, device="meta"), torch.zeros(1, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x, t, y)
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


def test_dit_b2_flops():
    pre, siamese = forward_flops(meta_model("DiT-B/2")), forward_flops(meta_model("DiT-B/2", "siamese"))
    # 43.6 GFLOPs is torch's count of the linear layers and patch embedding (the CPU fused attention
    # kernel has no FLOP formula); on meta tensors SDPA decomposes, so its two matmuls appear as bmm.
    dense = pre["aten.addmm"] + pre["aten.convolution"]
    assert abs(dense / 43.6e9 - 1) < 0.01, dense
    tokens, dim, depth = 256, 768, 12
    assert pre["aten.bmm"] == depth * 2 * (2 * tokens * tokens * dim)
    assert abs(sum(siamese.values()) / sum(pre.values()) - 1) < 0.005


# ---------------------------------------------------------------- equality with independent implementations


def diffusers_dit_from(model):
    """diffusers' DiTTransformer2DModel with our weights mapped by name, following the official DiT."""
    from diffusers import DiTTransformer2DModel

    heads = model.blocks[0].attn.num_heads
    dim = model.pos_embed.shape[-1]
    ref = DiTTransformer2DModel(
        num_attention_heads=heads, attention_head_dim=dim // heads, in_channels=model.in_channels,
        out_channels=model.out_channels, num_layers=len(model.blocks), sample_size=model.input_size,
        patch_size=model.patch_size, num_embeds_ada_norm=model.num_classes, norm_eps=1e-6,
    ).eval()
    ours = model.state_dict()
    sd = {"pos_embed.proj.weight": ours["x_embedder.proj.weight"], "pos_embed.proj.bias": ours["x_embedder.proj.bias"],
          "proj_out_1.weight": ours["final_layer.adaLN_modulation.1.weight"],
          "proj_out_1.bias": ours["final_layer.adaLN_modulation.1.bias"],
          "proj_out_2.weight": ours["final_layer.linear.weight"], "proj_out_2.bias": ours["final_layer.linear.bias"]}
    for i, block in enumerate(ref.transformer_blocks):
        p, b = f"transformer_blocks.{i}.", f"blocks.{i}."
        emb = p + "norm1.emb."
        pairs = {emb + "timestep_embedder.linear_1": "t_embedder.mlp.0", emb + "timestep_embedder.linear_2": "t_embedder.mlp.2",
                 p + "norm1.linear": b + "adaLN_modulation.1", p + "attn1.to_out.0": b + "attn.proj",
                 p + "ff.net.0.proj": b + "mlp.fc1", p + "ff.net.2": b + "mlp.fc2"}
        for theirs, mine in pairs.items():
            sd[theirs + ".weight"], sd[theirs + ".bias"] = ours[mine + ".weight"], ours[mine + ".bias"]
        sd[emb + "class_embedder.embedding_table.weight"] = ours["y_embedder.embedding_table.weight"]
        for name, w, bias in zip(("to_q", "to_k", "to_v"), ours[b + "attn.qkv.weight"].chunk(3), ours[b + "attn.qkv.bias"].chunk(3)):
            sd[f"{p}attn1.{name}.weight"], sd[f"{p}attn1.{name}.bias"] = w, bias
        # diffusers divides the frequency exponent by half-1; the official DiT (and ours) by half.
        block.norm1.emb.time_proj.downscale_freq_shift = 0
    ref.load_state_dict(sd, strict=True)
    return ref


def test_pre_norm_equals_diffusers_dit(inputs):
    model = randomize_(small("pre"))
    ref = diffusers_dit_from(model)
    x, t, y = inputs
    with torch.no_grad():
        out = model(x, t, y)
        expected = ref(x, timestep=t, class_labels=y).sample
    assert out.shape == (4, 8, 8, 8)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def reference_forward(sd, x, t, y, topologies, num_heads, patch_size):
    """docs/method.md section 3 restated with plain tensor ops on a state dict (our key names)."""
    dim = sd["pos_embed"].shape[-1]

    def lin(h, name):
        return h @ sd[name + ".weight"].T + sd[name + ".bias"]

    def ln(h, name=None):
        w, b = (sd[name + ".weight"], sd[name + ".bias"]) if name else (None, None)
        return F.layer_norm(h, (dim,), w, b, eps=1e-6)

    def attn(h, b):
        n, T, _ = h.shape
        q, k, v = lin(h, b + "attn.qkv").reshape(n, T, 3, num_heads, dim // num_heads).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dim // num_heads), dim=-1)
        return lin((weights @ v).transpose(1, 2).reshape(n, T, dim), b + "attn.proj")

    def mlp(h, b):
        return lin(F.gelu(lin(h, b + "mlp.fc1"), approximate="tanh"), b + "mlp.fc2")

    tokens = F.conv2d(x, sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"], stride=patch_size)
    tokens = tokens.flatten(2).transpose(1, 2) + sd["pos_embed"]
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half) / half)
    angles = t[:, None].float() * freqs
    temb = lin(F.silu(lin(torch.cat([angles.cos(), angles.sin()], 1), "t_embedder.mlp.0")), "t_embedder.mlp.2")
    c = temb + sd["y_embedder.embedding_table.weight"][y]
    X = Y = tokens
    for l, topology in enumerate(topologies):
        b = f"blocks.{l}."
        mods = lin(F.silu(c), b + "adaLN_modulation.1").chunk(6, dim=1)
        for i, sublayer in ((1, attn), (2, mlp)):
            shift, scale, gate = (m[:, None] for m in mods[3 * (i - 1): 3 * i])

            def f(h):
                return gate * sublayer(h * (1 + scale) + shift, b)

            if topology == "siamese":
                X = ln(X, f"{b}post_norm{i}")
                Z = f(ln(X + ln(Y, f"{b}pre_norm{i}")))
                X, Y = X + Z / math.sqrt(2 * (l + 1)), Y + Z
            elif topology == "pre":
                X = Y = Y + f(ln(Y))
            elif topology == "residual":  # ResiDual: the Post-Norm stream feeds F, Y accumulates
                Z = f(X)
                X, Y = ln(X + Z, f"{b}norm{i}"), Y + Z
            elif topology == "deepnorm":
                X = Y = ln((2 * len(topologies)) ** 0.25 * Y + f(Y), f"{b}norm{i}")
            else:
                X = Y = ln(Y + f(Y), f"{b}norm{i}")
    if topologies[0] == "siamese":
        H = ln(X, "fusion.norm_x") + ln(Y, "fusion.norm_y")
    elif topologies[0] == "residual":
        H = X + ln(Y, "fusion.norm_y")
    else:
        H = Y
    shift, scale = lin(F.silu(c), "final_layer.adaLN_modulation.1").chunk(2, dim=1)
    out = lin(ln(H) * (1 + scale[:, None]) + shift[:, None], "final_layer.linear")
    n, side, p = x.shape[0], x.shape[-1] // patch_size, patch_size
    return out.reshape(n, side, side, p, p, -1).permute(0, 5, 1, 3, 2, 4).reshape(n, -1, side * p, side * p)


@pytest.mark.parametrize("topology", ["siamese", "post", "mixln", "residual", "deepnorm"])
def test_forward_equals_functional_restatement(topology, inputs):
    model = randomize_(small(topology))
    if topology == "mixln":
        assert model.block_topologies == ["post", "pre", "pre"]
    x, t, y = inputs
    with torch.no_grad():
        out = model(x, t, y)
        expected = reference_forward(model.state_dict(), x, t, y, model.block_topologies, 4, 2)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- initialisation


def test_siamese_init_output_zero_and_y_stream_is_the_embedding(inputs):
    model = small("siamese")
    x, t, y = inputs
    states = []
    for block in model.blocks:
        block.register_forward_hook(lambda mod, args, out: states.append(out))
    with torch.no_grad():
        out = model(x, t, y)
        embedding = model.x_embedder(x) + model.pos_embed
    assert torch.equal(out, torch.zeros_like(out))
    assert len(states) == len(model.blocks)
    for X, Y in states:
        assert torch.equal(Y, embedding)
        assert not torch.equal(X, embedding)  # X is re-normalised by its post norms


def test_dit_initialisation_facts():
    model = small("siamese", hidden_size=256, depth=2)
    for block in model.blocks:
        assert not block.adaLN_modulation[-1].weight.any() and not block.adaLN_modulation[-1].bias.any()
        for name in ("pre_norm1", "post_norm2"):
            norm = getattr(block, name)
            assert torch.equal(norm.weight, torch.ones_like(norm.weight)) and not norm.bias.any()
        assert block.input_norm1.weight is None  # DiT's own non-affine norm
        assert block.attn.qkv.weight.std() > 0 and block.attn.fused_attn
    for p in (model.final_layer.linear.weight, model.final_layer.adaLN_modulation[-1].weight):
        assert not p.any()
    assert not model.pos_embed.requires_grad
    torch.testing.assert_close(model.pos_embed[0], sincos_pos_embed_2d(256, 4).float(), rtol=0, atol=0)
    assert abs(model.y_embedder.embedding_table.weight.std().item() - 0.02) < 0.002
    assert abs(model.t_embedder.mlp[0].weight.std().item() - 0.02) < 0.002
    assert model.y_embedder.embedding_table.num_embeddings == SMALL["num_classes"] + 1
    pre = small("pre")
    assert pre.blocks[0].norm1.weight is None and not any("norm" in k for k in pre.state_dict() if k.startswith("blocks"))


def test_label_dropout_uses_the_null_class(inputs):
    model = small("pre", class_dropout_prob=1.0).train()
    table = model.y_embedder
    assert torch.equal(table.token_drop(torch.tensor([1, 2])), torch.tensor([10, 10]))
    assert torch.equal(table.token_drop(torch.tensor([1, 2]), torch.tensor([0, 1])), torch.tensor([1, 10]))
    model = randomize_(small("pre"))
    x, t, y = inputs
    with torch.no_grad():
        dropped = model(x, t, y, force_drop_ids=torch.ones(4))
        null = model(x, t, torch.full_like(y, 10))
    torch.testing.assert_close(dropped, null, rtol=0, atol=0)


# ---------------------------------------------------------------- classifier-free guidance


def cfg_batch(inputs):
    x, t, _ = inputs
    x = torch.cat([x[:2], x[:2]])
    return x, torch.cat([t[:2], t[:2]]), torch.tensor([3, 7, 10, 10])


@pytest.mark.parametrize("guided_channels", [3, "all"])
def test_cfg_scale_one_is_conditional_and_guided_channels(guided_channels, inputs):
    model = randomize_(small("siamese"))
    x, t, y = cfg_batch(inputs)
    n_guided = 4 if guided_channels == "all" else guided_channels
    with torch.no_grad():
        plain = model(x, t, y)
        one = model.forward_with_cfg(x, t, y, 1.0, guided_channels=guided_channels)
        four = model.forward_with_cfg(x, t, y, 4.0, guided_channels=guided_channels)
    cond, uncond = plain.chunk(2)
    assert one.shape == plain.shape == (4, 8, 8, 8)
    torch.testing.assert_close(one[:, :n_guided], torch.cat([cond, cond])[:, :n_guided], rtol=0, atol=1e-6)
    torch.testing.assert_close(one[:, n_guided:], plain[:, n_guided:], rtol=0, atol=0)
    torch.testing.assert_close(four[:, n_guided:], plain[:, n_guided:], rtol=0, atol=0)
    expected = uncond + 4.0 * (cond - uncond)
    torch.testing.assert_close(four[:, :n_guided], torch.cat([expected, expected])[:, :n_guided], rtol=0, atol=1e-5)
    assert not torch.allclose(four[:2, :n_guided], cond[:, :n_guided], atol=1e-3)


def test_cfg_rejects_bad_arguments(inputs):
    model = small("pre")
    x, t, y = cfg_batch(inputs)
    with pytest.raises(ValueError, match="guided_channels"):
        model.forward_with_cfg(x, t, y, 1.5, guided_channels=5)
    with pytest.raises(ValueError, match="even batch"):
        model.forward_with_cfg(x[:3], t[:3], y[:3], 1.5)


# ---------------------------------------------------------------- checkpoint layouts


def official_dit_state_dict(depth=3, dim=64, patch_size=2, in_channels=4, input_size=8, num_classes=10, seed=5):
    """A state dict with the official facebookresearch/DiT key names and shapes (docs/method.md section 3)."""
    gen = torch.Generator().manual_seed(seed)
    out_channels = 2 * in_channels
    shapes = {
        "pos_embed": (1, (input_size // patch_size) ** 2, dim),
        "x_embedder.proj.weight": (dim, in_channels, patch_size, patch_size), "x_embedder.proj.bias": (dim,),
        "t_embedder.mlp.0.weight": (dim, 256), "t_embedder.mlp.0.bias": (dim,),
        "t_embedder.mlp.2.weight": (dim, dim), "t_embedder.mlp.2.bias": (dim,),
        "y_embedder.embedding_table.weight": (num_classes + 1, dim),
        "final_layer.linear.weight": (patch_size ** 2 * out_channels, dim),
        "final_layer.linear.bias": (patch_size ** 2 * out_channels,),
        "final_layer.adaLN_modulation.1.weight": (2 * dim, dim), "final_layer.adaLN_modulation.1.bias": (2 * dim,),
    }
    for i in range(depth):
        for name, (rows, cols) in {"adaLN_modulation.1": (6 * dim, dim), "attn.qkv": (3 * dim, dim),
                                   "attn.proj": (dim, dim), "mlp.fc1": (4 * dim, dim), "mlp.fc2": (dim, 4 * dim)}.items():
            shapes[f"blocks.{i}.{name}.weight"], shapes[f"blocks.{i}.{name}.bias"] = (rows, cols), (rows,)
    return {k: 0.1 * torch.randn(s, generator=gen) for k, s in shapes.items()}


def public_siamese_dit_state_dict(depth=3, dim=64, seed=6):
    """The official names plus the public SiameseNorm DiT norms: prenorm/postnorm per sublayer and at the top."""
    gen = torch.Generator().manual_seed(seed)
    sd = official_dit_state_dict(depth, dim)
    norms = ["prenorm", "postnorm"] + [f"blocks.{i}.{n}{j}" for i in range(depth) for n in ("prenorm", "postnorm") for j in (1, 2)]
    for name in norms:
        sd[name + ".weight"] = 1 + 0.1 * torch.randn(dim, generator=gen)
        sd[name + ".bias"] = 0.1 * torch.randn(dim, generator=gen)
    return sd


def test_official_layout_loads_strictly_into_pre_norm(tmp_path, inputs):
    official = official_dit_state_dict()
    torch.save(official, tmp_path / "DiT-tiny.pt")
    model = small("pre")
    load_weights(model, tmp_path / "DiT-tiny.pt", strict=True)
    for k, v in official.items():
        assert torch.equal(model.state_dict()[k], v), k
    x, t, y = inputs
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y), reference_forward(official, x, t, y, ["pre"] * 3, 4, 2),
                                   rtol=0, atol=1e-5)
    incomplete = {k: v for k, v in official.items() if k != "blocks.1.attn.qkv.weight"}
    with pytest.raises(CheckpointError, match=r"1 missing keys \[blocks\.1\.attn\.qkv\.weight\]"):
        load_weights(small("pre"), incomplete)
    with pytest.raises(CheckpointError, match="missing keys"):
        load_weights(small("siamese"), official)  # a Pre-Norm checkpoint lacks the Siamese norms


def test_public_siamese_layout_loads_strictly(tmp_path, inputs):
    from safetensors.torch import save_file

    public = public_siamese_dit_state_dict()
    save_file(public, str(tmp_path / "siamese.safetensors"))
    model = small("siamese")
    load_weights(model, tmp_path / "siamese.safetensors", strict=True)
    # Top level: `postnorm` normalises X, `prenorm` normalises Y.
    assert torch.equal(model.fusion.norm_x.weight, public["postnorm.weight"])
    assert torch.equal(model.fusion.norm_y.bias, public["prenorm.bias"])
    assert torch.equal(model.blocks[2].pre_norm1.weight, public["blocks.2.prenorm1.weight"])
    assert torch.equal(model.blocks[0].post_norm2.bias, public["blocks.0.postnorm2.bias"])
    renamed = DiT.convert_state_dict(public, model)
    x, t, y = inputs
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y), reference_forward(renamed, x, t, y, ["siamese"] * 3, 4, 2),
                                   rtol=0, atol=1e-5)
    del public["blocks.1.postnorm1.weight"]
    with pytest.raises(CheckpointError, match=r"blocks\.1\.post_norm1\.weight"):
        load_weights(small("siamese"), public)


# ---------------------------------------------------------------- training switches


def test_gradient_checkpointing_gives_the_same_gradients(inputs):
    x, t, y = inputs
    grads, calls = [], []
    for enabled in (False, True):
        model = randomize_(small("siamese")).train()
        model.set_grad_checkpointing(enabled)
        count = [0]
        model.blocks[0].register_forward_pre_hook(lambda *a: count.__setitem__(0, count[0] + 1))
        model(x, t, y, force_drop_ids=torch.tensor([0, 1, 0, 0])).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
        calls.append(count[0])
    assert calls == [1, 2]  # the checkpointed block is recomputed in backward
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=1e-6, msg=name)


def test_bf16_autocast_keeps_streams_and_output_fp32(inputs):
    model = randomize_(small("siamese"))
    x, t, y = inputs
    seen = {}
    model.blocks[0].register_forward_hook(lambda m, a, out: seen.update(streams=[s.dtype for s in out]))
    model.blocks[0].input_norm1.register_forward_hook(lambda m, a, out: seen.update(norm=out.dtype))
    with torch.no_grad():
        reference = model(x, t, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, t, y)
    assert seen == {"streams": [torch.float32, torch.float32], "norm": torch.float32}
    assert out.dtype == torch.float32
    assert ((out - reference).norm() / reference.norm()).item() < 0.03


def test_bad_configuration_errors():
    with pytest.raises(ValueError, match="valid topologies are"):
        DiT(**SMALL, topology="sandwich")
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        DiT(**{**SMALL, "input_size": 9})
