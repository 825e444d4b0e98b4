"""Diffusion-Adaptive Routing (``dar``) and SiameseNorm with a routed Pre-Norm stream (``siamese_dar``) against a
re-statement of their equations, with every query and a chunk size at which chunks matter."""
import math

import pytest
import torch

from common.cli import InputError
from common.topologies import resolve_topology
from diffusion.models import DiT
from tests.test_deit import randomize_

DIT = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=4, num_heads=4, num_classes=10)
QUERIES = ["static", "static_t", "dynamic"]


def dit(topology, **kw):
    torch.manual_seed(0)
    return randomize_(DiT(**{**DIT, "topology": topology, **kw})).eval()


def route(sources, q, eps=1e-6):
    """``sum_i softmax_i(q . RMSNorm(v_i) / sqrt(D)) v_i``, stacked as the equation reads."""
    values = torch.stack(sources)                                           # (N, B, T, D)
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    logits = (keys * q).sum(-1) / math.sqrt(values.shape[-1])               # q: (D,), (B, 1, D) or (B, T, D)
    return (logits.softmax(0).unsqueeze(-1) * values).sum(0)


def readable(k, chunk):
    """Indices of the outputs sublayer ``k`` reads (``v_j`` is sublayer ``j - 1``'s output, ``v_0`` the embedding):
    ``v_0``, the last output of every finished chunk, and its own chunk's outputs so far."""
    if not chunk:
        return list(range(k + 1))
    own = k // chunk
    return [0] + [(c + 1) * chunk for c in range(own)] + list(range(own * chunk + 1, k + 1))


def query(router, query_kind, history, time_offset):
    if query_kind == "dynamic":
        return history[-1] @ router.query_weight.T                           # W_k v_k, per token
    return router.query if time_offset is None else router.query + time_offset[:, None]


def reference(model, x, t, y, query_kind, chunk, siamese):
    t_emb = model.t_embedder(t)
    c = t_emb + model.y_embedder(y, False)
    tokens = model.x_embedder(x) + model.pos_embed
    time_offset = (t_emb @ model.streams.time_weight.T + model.streams.time_bias) if query_kind == "static_t" else None
    v, stream_x = [tokens], tokens
    for l, block in enumerate(model.blocks):
        ctx = block.adaLN_modulation(c)
        for j, router, sublayer in ((1, block.router1, block.sublayer1), (2, block.router2, block.sublayer2)):
            k = 2 * l + j - 1
            sources = [v[i] for i in readable(k, chunk)]
            h = sources[0] if k == 0 else route(sources, query(router, query_kind, v, time_offset))
            if siamese:  # X <- LN_post(X); Z <- F(LN_in(X + LN_pre(routed)))
                stream_x = getattr(block, f"post_norm{j}")(stream_x)
                h = getattr(block, f"input_norm{j}")(stream_x + getattr(block, f"pre_norm{j}")(h))
            else:
                h = getattr(block, f"norm{j}")(h)
            z = sublayer(h, ctx)
            if siamese:
                stream_x = stream_x + z / math.sqrt(2 * (l + 1))
            v.append(z)
    last = 2 * len(model.blocks)
    sources = [v[i] for i in readable(last - 1, chunk)] + [v[last]]  # the summaries and the whole last chunk
    fusion = model.fusion
    h = route(sources, query(fusion.router, query_kind, v, time_offset))
    if siamese:
        h = fusion.norm_x(stream_x) + fusion.norm_y(h)
    return model.unpatchify(model.final_layer(h, c))


@pytest.mark.parametrize("topology", ["dar", "siamese_dar"])
@pytest.mark.parametrize("query_kind", QUERIES)
@pytest.mark.parametrize("chunk", [3, 0])
def test_equals_the_equations(topology, query_kind, chunk, latents):
    """Depth 4 is 8 sublayers: chunks of 3 are outputs 1-3, 4-6 and 7-8, so the summaries replace outputs."""
    model = dit(topology, dar_query=query_kind, dar_chunk=chunk)
    x, t, y = latents
    with torch.no_grad():
        ours = model(x, t, y)
        ref = reference(model, x, t, y, query_kind, chunk, siamese=topology == "siamese_dar")
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_chunks_and_time_change_what_is_read(latents):
    x, t, y = latents
    with torch.no_grad():
        chunked, whole = dit("dar", dar_chunk=3)(x, t, y), dit("dar", dar_chunk=0)(x, t, y)
        assert (chunked - whole).abs().max() > 1e-3
        model = dit("dar", dar_query="static_t")
        other_t = model(x, t.flip(0), y)
        model.streams.time_weight.zero_()
        model.streams.time_bias.zero_()
        assert (model(x, t, y) - model(x, t.flip(0), y)).abs().max() < (model(x, t, y) - other_t).abs().max()


def test_init_starts_static_and_siamese_dar_starts_as_siamese(latents):
    """Queries and E zero: every router reads the mean of its history; without chunks the mean of SiameseNorm's
    history is ``Y / (k + 1)``, which ``LN_pre`` normalises to what SiameseNorm reads (to LayerNorm's epsilon)."""
    routed = DiT(**DIT, topology="siamese_dar", dar_chunk=0)
    assert not routed.streams.time_weight.any() and not routed.fusion.router.query.any()
    assert not any(b.router2.query.any() for b in routed.blocks)
    plain = DiT(**DIT, topology="siamese")
    torch.manual_seed(3)
    randomize_(plain)
    shared = {k: v for k, v in plain.state_dict().items()}
    missing, unexpected = routed.load_state_dict(shared, strict=False)
    assert not unexpected and all("router" in k or k.startswith("streams.") for k in missing)
    with torch.no_grad():
        torch.testing.assert_close(routed.eval()(*latents), plain.eval()(*latents), rtol=1e-3, atol=1e-4)


def test_options_and_families_are_checked():
    with pytest.raises(InputError, match="dar_query='tim' is not a routing query; choose one of static, static_t"):
        DiT(**DIT, topology="dar", dar_query="tim")
    with pytest.raises(InputError, match="dar_chunk=-1 must be a whole number"):
        DiT(**DIT, topology="siamese_dar", dar_chunk=-1)
    with pytest.raises(InputError, match="the dar topology is not offered for DeiT"):
        resolve_topology("dar", 4, "deit")
    params = {q: sum(p.numel() for p in DiT(**DIT, topology="dar", dar_query=q).parameters()) for q in QUERIES}
    pre = sum(p.numel() for p in DiT(**DIT, topology="pre").parameters())
    # 2 x depth - 1 routers in the blocks (block 0's first reads the embedding alone) and one at the output, each
    # with w (D) or W (D x D); static_t adds E and b once; DiT's norms of a routed sublayer are its own, non-affine
    assert params["static"] - pre == 8 * 64
    assert params["static_t"] - params["static"] == 64 * 64 + 64
    assert params["dynamic"] - pre == 8 * 64 * 64
