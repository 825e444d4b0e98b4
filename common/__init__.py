"""Pieces shared by the vision (DeiT) and diffusion (DiT) families."""
