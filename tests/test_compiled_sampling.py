"""diffusion.sample --compile: the model and the VAE decoder compiled once give eager's samples on the same noise,
the last, smaller batch padded to the compiled shape instead of compiling again."""
import torch

from diffusion.sampling.decoder import Decoder
from diffusion.sampling.sampler import Sampler
from tests.test_hub import tiny_dit, tiny_vae


def test_compiled_sampling_equals_eager_and_compiles_once(tmp_path):
    torch._dynamo.reset()  # another test's compiled DiT in this process would count as a first compile
    vae = tiny_vae(tmp_path / "vae")
    model, spec = tiny_dit("siamese", in_channels=4, autoencoder=str(vae))
    compiled_model, _ = tiny_dit("siamese", in_channels=4, autoencoder=str(vae))
    diffusion = spec.diffusion(sampling_steps=3)
    eager = Sampler(model, spec, Decoder(str(vae), "cpu"), diffusion, cfg_scale=2.0, seed=5)
    compiled = Sampler(compiled_model, spec, Decoder(str(vae), "cpu"), spec.diffusion(sampling_steps=3),
                       cfg_scale=2.0, seed=5, compile=True)
    g = torch.Generator().manual_seed(3)
    x, t, y = torch.randn(8, 4, 8, 8, generator=g), torch.randint(0, 1000, (8,), generator=g), torch.arange(8) % 5
    with torch.no_grad():  # one forward of the guided batch's shape (4 samples, twice): equal to 1e-5
        torch.testing.assert_close(compiled_model(x, t, y), model(x, t, y), atol=1e-5, rtol=1e-5)
    with torch._dynamo.config.patch(error_on_recompile=True):  # a second compile raises
        indices = torch.arange(0, 4)
        # three guided DDPM steps carry the forward's rounding along the chain: equal to 1e-3
        torch.testing.assert_close(compiled.latents(indices, indices % 5), eager.latents(indices, indices % 5),
                                   atol=1e-3, rtol=1e-3)
        for indices in (torch.arange(0, 4), torch.arange(4, 7)):  # a full batch, then the last one of three
            labels = indices % spec.num_classes
            want, got = eager(indices, labels), compiled(indices, labels)
            assert got.shape == want.shape == (len(indices), 3, 8, 8) and got.dtype == torch.uint8
            assert (got.int() - want.int()).abs().max() <= 1  # one uint8 level: the latents' rounding
    assert compiled.compiled_batch == 4
