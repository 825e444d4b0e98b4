"""DeiT on the shared residual block; importing this registers our models with timm."""
from vision import deit  # noqa: F401  (registers deit_*_{siamese,post,mixln}_patch16_224)
from vision.deit import DeiTBlock, SiameseNormVisionTransformer

__all__ = ["DeiTBlock", "SiameseNormVisionTransformer", "deit"]
