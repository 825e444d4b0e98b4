"""Sample quality as the DiT tables measure it (ADM's evaluator: FID, sFID, IS, Precision/Recall; KID on request).

* :mod:`~diffusion.evaluation.images`: image sets (folders, ADM ``.npz`` files, Fashion-MNIST, tensors);
* :mod:`~diffusion.evaluation.features`: the feature extractors (torch-fidelity's TF-compatible Inception with
  ADM's sFID layer, the Fashion-MNIST classifier) and the feature pass;
* :mod:`~diffusion.evaluation.metrics`: the maths on features (Frechet distance, IS, Precision/Recall);
* :mod:`~diffusion.evaluation.reference`: reference statistics in ADM's layout, read, written and built;
* :mod:`~diffusion.evaluation.evaluator`: :class:`Evaluator` and :func:`compute_metrics`, what ``python -m
  diffusion.fid`` and the in-training FID run.
"""
from diffusion.evaluation.evaluator import Evaluator, compute_metrics
from diffusion.evaluation.images import images_to_uint8, open_images
from diffusion.evaluation.metrics import MetricsError, frechet_distance
from diffusion.evaluation.reference import build_reference_statistics, load_reference_statistics

__all__ = ["Evaluator", "compute_metrics", "images_to_uint8", "open_images", "MetricsError", "frechet_distance",
           "build_reference_statistics", "load_reference_statistics"]
