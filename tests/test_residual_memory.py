"""SiameseNorm's fused norm chain (``recompute_norms``): the same outputs, the same gradients to float32 round-off,
less saved for backward, in eager mode and compiled."""
import pytest
import timm
import torch
import torch.nn.functional as F

import vision  # noqa: F401  (registers our models)
from diffusion.models import DiT
from benchmarks.harness import saved_activation_mb
from tests.deit_reference import siamese_deit_forward
from tests.test_deit import SMALL as DEIT_SMALL, randomize_ as randomize_deit_, to_public_layout
from tests.test_dit_models import SMALL as DIT_SMALL, randomize_ as randomize_dit_, reference_forward

DEIT = dict(DEIT_SMALL, drop_path_rate=0.0)


def deit(recompute_norms, **kw):
    torch.manual_seed(0)
    return randomize_deit_(timm.create_model("deit_tiny_siamese_patch16_224", recompute_norms=recompute_norms,
                                             **{**DEIT, **kw})).train()


def dit(recompute_norms, **kw):
    torch.manual_seed(0)
    return randomize_dit_(DiT(**{**DIT_SMALL, "topology": "siamese", "recompute_norms": recompute_norms, **kw})).train()


def dit_loss(model, latents):
    x, t, y = latents
    return model(x, t, y, force_drop_ids=torch.zeros_like(y)).square().mean()


def output_and_grads(model, loss_fn, seed=0, run=None):
    """Loss and parameter gradients of ``model`` after ``loss_fn(run)``; ``run`` is e.g. its compiled form."""
    torch.manual_seed(seed)  # the same drop-path masks for every model
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model if run is None else run)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b):
    """Outputs bit for bit (the fused chain runs the norms' own kernels), every gradient to 1e-5 relative to its
    norm (autograd sums the contributions to one tensor in another order)."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    assert_grads_close(grads_a, [grads_b[n] for n in grads_b], list(grads_b), tol=1e-5)


@pytest.mark.parametrize("variant", [{}, {"normalized_input": False}, {"depth_scaling": False},
                                     {"drop_path_rate": 0.5}])
def test_deit_recompute_gives_identical_outputs_and_gradients(variant, images):
    """The fused chain against the three norm modules."""
    loss = lambda m: m(images).square().mean()  # noqa: E731
    assert_same(output_and_grads(deit(True, **variant), loss), output_and_grads(deit(False, **variant), loss))


@pytest.mark.parametrize("variant", [{}, {"normalized_input": False}, {"depth_scaling": False}])
def test_dit_recompute_gives_identical_outputs_and_gradients(variant, latents):
    loss = lambda m: dit_loss(m, latents)  # noqa: E731
    assert_same(output_and_grads(dit(True, **variant), loss), output_and_grads(dit(False, **variant), loss))


def test_recompute_inside_block_checkpointing(images):
    """Nested in the block-level gradient checkpointing (set_grad_checkpointing), still the same gradients."""
    loss = lambda m: m(images).square().mean()  # noqa: E731
    nested = deit(True)
    nested.set_grad_checkpointing(True)
    assert_same(output_and_grads(nested, loss), output_and_grads(deit(False), loss))


def assert_grads_close(grads, reference, names, tol=1e-5):
    """Every gradient equals the reference's to ``tol`` relative to its norm (float32 round-off: the model computes
    ``X + Z * (1/c)`` in one fused op where the re-statement divides, uses fused attention, and the fused chain
    hands autograd the gradients of X and Y separately)."""
    for name, expected in zip(names, reference):
        got = grads[name]
        assert ((got - expected).norm() / expected.norm().clamp_min(1e-12)).item() <= tol, name


def test_deit_gradients_equal_the_functional_restatement(images):
    model = deit(True)
    _, grads = output_and_grads(model, lambda m: m(images).square().mean())
    public = {k: v.detach().clone().requires_grad_(True) for k, v in to_public_layout(model.state_dict()).items()}
    ours_to_public = dict(zip(model.state_dict(), public))
    loss = siamese_deit_forward(public, images, depth=4, num_heads=3, patch_size=4).square().mean()
    names = [n for n in grads]
    reference = torch.autograd.grad(loss, [public[ours_to_public[n]] for n in names])
    assert_grads_close(grads, reference, names)


def test_dit_gradients_equal_the_functional_restatement(latents):
    model = dit(True)
    _, grads = output_and_grads(model, lambda m: dit_loss(m, latents))
    sd = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in model.state_dict(keep_vars=True).items()}
    x, t, y = latents
    loss = reference_forward(sd, x, t, y, model.block_topologies, 4, 2).square().mean()
    names = [n for n in grads]
    assert_grads_close(grads, torch.autograd.grad(loss, [sd[n] for n in names]), names)


def stream_mb(model, batch, tokens):
    return batch * tokens * model.embed_dim * 4 / 2**20


def test_recompute_keeps_one_stream_tensor_per_sublayer_more_than_pre_norm(images):
    """Eager, fp32, counted in stream tensors (batch x tokens x dim floats) against Pre-Norm, which keeps Y and
    LN(Y) per sublayer. Fused, Siamese keeps X and Y (the sublayer keeps its input as in Pre-Norm): one more,
    except in the first sublayer, where X is Y. Stored, it also keeps the sum X' + LN_pre(Y). Both keep X and the
    sum in the output fusion LN_out(LN_x(X) + LN_y(Y)), and the statistics (2 floats a token) of every norm,
    against Pre-Norm's one norm per sublayer and the final norm."""
    loss = lambda m, b: m(b).square().mean()  # noqa: E731
    off = torch.autocast("cpu", enabled=False)
    torch.manual_seed(0)
    pre = timm.create_model("deit_tiny_siamese_patch16_224", topology="pre", **DEIT).train()
    base = saved_activation_mb(pre, loss, images, off)
    stream, stats = stream_mb(pre, 3, 65), 2 / DEIT["embed_dim"]
    sublayers, pre_norms = 2 * DEIT["depth"], 2 * DEIT["depth"] + 1
    extra = {rc: (saved_activation_mb(deit(rc), loss, images, off) - base) / stream for rc in (True, False)}
    assert extra[True] == pytest.approx(sublayers - 1 + 2 + (3 * sublayers + 3 - pre_norms) * stats, abs=1e-6)
    assert extra[False] == pytest.approx(2 * sublayers - 1 + 2 + (3 * sublayers + 3 - pre_norms) * stats, abs=1e-6)


def test_compiled_fused_chain_equals_eager(images):
    """torch.compile (inductor's forward/backward split, without code generation) traces the fused chain into
    one graph: the same loss and gradients as eager to 1e-5, and no more kept for backward than eager keeps."""
    torch._dynamo.reset()
    loss = lambda m, b: m(b).square().mean()  # noqa: E731
    model = deit(True, depth=2)
    eager = output_and_grads(model, lambda m: loss(m, images))
    compiled = torch.compile(model, backend="aot_eager_decomp_partition", fullgraph=True)
    got = output_and_grads(model, lambda m: loss(m, images), run=compiled)
    torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-6)
    assert_grads_close(got[1], list(eager[1].values()), list(eager[1]))
    off = torch.autocast("cpu", enabled=False)
    assert saved_activation_mb(compiled, loss, images, off) <= saved_activation_mb(model, loss, images, off)
    torch._dynamo.reset()


def test_norm_modules_run_without_autograd_and_the_fused_chain_with_it(images):
    """Evaluation and sampling (no grad) run the three norm modules (their hooks fire); under autograd the fused
    chain reads their parameters instead."""
    model = deit(True).eval()
    calls = []
    model.blocks[0].post_norm1.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        model(images)
    assert calls == [1]
    model(images).sum().backward()
    assert calls == [1]
    assert model.blocks[0].post_norm1.weight.grad.abs().sum() > 0


def test_state_dict_keys_do_not_depend_on_recompute():
    assert list(deit(True).state_dict()) == list(deit(False).state_dict())
    assert list(dit(True).state_dict()) == list(dit(False).state_dict())
    assert "recompute_norms=False" in repr(dit(False).blocks[0])
