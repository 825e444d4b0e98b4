"""DeiT on the shared residual topologies; importing this registers our models with timm.

``python -m vision.<command>`` imports this package before its own module; there it registers nothing (and imports
no timm), so that ``--help`` and a refused command line come back at once: each command registers the models
when it builds one. The names below are then loaded on first use.
"""
import sys

# While `python -m` locates its module, sys.argv[0] is "-m" (the documented behaviour of `python -m`).
if sys.argv[:1] != ["-m"]:
    from vision import deit  # noqa: F401  (registers vision.deit.MODEL_NAMES)
    from vision.deit import DeiTBlock, SiameseNormVisionTransformer

__all__ = ["DeiTBlock", "SiameseNormVisionTransformer", "deit"]


def __getattr__(name: str):
    """``vision.deit``, ``vision.DeiTBlock``, ... when the package was imported by ``python -m`` (registers then)."""
    if name in __all__:
        from vision import deit

        return deit if name == "deit" else getattr(deit, name)
    raise AttributeError(f"module 'vision' has no attribute {name!r}")
