"""What REPA's encoder input costs on ImageNet-1k: stored images vs precomputed features (docs/dit.md, REPA).

    python -m scripts.repa_costs                     # ImageNet-1k, 256 px, DINOv2 ViT-B/14 at 224, SiT-B/2 and -XL/2

Bytes follow from the shapes; FLOPs are counted by ``torch.utils.flop_counter`` on meta tensors (two per
multiply-add, nothing is computed), a training example taken as three forwards (forward and backward).
"""
from __future__ import annotations

import argparse
import json

IMAGENET_TRAIN = 1_281_167


def forward_flops(fn) -> int:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        fn()
    return counter.get_total_flops()


def costs(images: int = IMAGENET_TRAIN, image_size: int = 256, encoder: str = "vit_base_patch14_dinov2",
          encoder_size: int = 224, models=("DiT-B/2", "DiT-XL/2"), batch: int = 256) -> dict:
    import timm
    import torch

    from diffusion.models import DiT_models

    latent = image_size // 8
    with torch.device("meta"):
        vit = timm.create_model(encoder, pretrained=False, num_classes=0, img_size=encoder_size)
        encoder_flops = forward_flops(lambda: vit.forward_features(torch.empty(1, 3, encoder_size, encoder_size)))
        tokens, width = vit.patch_embed.num_patches, vit.embed_dim
        model_flops = {}
        for name in models:
            dit = DiT_models[name](input_size=latent)
            model_flops[name] = forward_flops(lambda: dit(torch.empty(1, 4, latent, latent), torch.empty(1),
                                                          torch.zeros(1, dtype=torch.long)))
    per_image = {"latents (fp16 mean + logvar, 2 views)": 2 * 2 * 4 * latent * latent * 2,
                 "images (uint8)": 3 * image_size * image_size,
                 "features (fp16, 2 views)": 2 * tokens * width * 2,
                 "features (fp16, unflipped view)": tokens * width * 2}
    return {"images": images, "bytes_per_image": per_image,
            "gigabytes": {k: v * images / 1e9 for k, v in per_image.items()},
            "encoder_gflops": encoder_flops / 1e9,
            "training_example_gflops": {k: 3 * v / 1e9 for k, v in model_flops.items()},
            "encoder_share_of_a_step": {k: encoder_flops / (3 * v) for k, v in model_flops.items()},
            "precompute_steps_equivalent": 2 * images / batch}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m scripts.repa_costs", description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=IMAGENET_TRAIN, help="training images (ImageNet-1k's by default)")
    args = p.parse_args(argv)
    result = costs(args.images)
    for what, gb in result["gigabytes"].items():
        print(f"{what}: {result['bytes_per_image'][what] / 1024:.0f} KiB per image, {gb:.1f} GB")
    print(f"encoder forward: {result['encoder_gflops']:.1f} GFLOPs")
    for name, share in result["encoder_share_of_a_step"].items():
        print(f"{name}: {result['training_example_gflops'][name]:.1f} GFLOPs per training example; the encoder adds "
              f"{100 * share:.1f}%")
    print(f"precomputing both views once: the encoder work of {result['precompute_steps_equivalent']:.0f} steps of "
          "batch 256")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
