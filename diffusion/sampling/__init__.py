"""Sampling a DiT, one job per module; ``python -m diffusion.sample`` is the command line over it, and the trainer's
grids and in-training FID use the same :class:`~diffusion.sampling.sampler.Sampler`.

* :mod:`~diffusion.sampling.options`: the samplers and precisions offered, the error bad options raise;
* :mod:`~diffusion.sampling.noise`: each sample's own noise stream, seeded by ``(seed, i)``;
* :mod:`~diffusion.sampling.guidance`: classifier-free guidance in the official DiT convention;
* :mod:`~diffusion.sampling.chains`: the objectives' chains, DDPM's reverse chain and the transport's ODE/SDE;
* :mod:`~diffusion.sampling.decoder`: model outputs to uint8 images (the VAE, undoing the latents' scaling);
* :mod:`~diffusion.sampling.sampler`: :class:`Sampler`, a model, its objective, decoder and options;
* :mod:`~diffusion.sampling.sample_sets`: chunked sample sets on any number of processes, with resume;
* :mod:`~diffusion.sampling.grids`: readable grids with class names.

    model, spec, _ = load_dit("ema.safetensors")
    sampler = Sampler(model, spec, Decoder(spec.autoencoder, "cuda"), spec.diffusion(sampling_steps=250), device="cuda")
    images = sampler(torch.arange(8), torch.tensor([207, 360, 387, 974, 88, 979, 417, 279]))   # uint8 (8, 3, 256, 256)
"""
