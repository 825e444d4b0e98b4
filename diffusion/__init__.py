"""Diffusion transformers (DiT) with switchable residual topology, Gaussian diffusion, latents, sampling, FID."""
