"""DeiT on the shared residual topologies; importing this registers our models with timm."""
from vision import deit  # noqa: F401  (registers vision.deit.MODEL_NAMES)
from vision.deit import DeiTBlock, SiameseNormVisionTransformer

__all__ = ["DeiTBlock", "SiameseNormVisionTransformer", "deit"]
