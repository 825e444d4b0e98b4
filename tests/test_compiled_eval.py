"""vision.evaluate compile=true: the model compiled once for the first batch's shape gives eager's Top-1 and Top-5
counts and its loss, the last, smaller batch padded to that shape (the padding counted nowhere), not compiled again.

The one test of this file compiles (about 40 s on a CPU); nothing else here does, so it shares no compiled code.
"""
import timm
import torch
from safetensors.torch import save_file

from tests.test_vision_data import make_folder
from vision import evaluate as vision_evaluate

MODEL = "deit_tiny_siamese_patch16_224"
KWARGS = "{patch_size: 8, embed_dim: 16, depth: 1, num_heads: 2}"


def test_compiled_evaluation_equals_eager_with_a_last_partial_batch(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "data", per_class=5)  # 10 images in batches of 4: 4, 4 and a last one of 2
    torch.manual_seed(0)
    model = timm.create_model(MODEL, img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2,
                              num_classes=2).eval()
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    settings = [f"model.name={MODEL}", f"model.kwargs={KWARGS}", "data.dataset=imagefolder", f"data.path={root}",
                "data.num_classes=2", "data.input_size=16", "data.crop_pct=1.0", "data.num_workers=0",
                "batch_size=4", f"checkpoint={tmp_path / 'model.safetensors'}", f"output={tmp_path / 'eval.json'}"]
    compiled_models, compile_for_eval = [], vision_evaluate.compile_for_eval

    def compile_and_keep(module):  # the real compilation; the test keeps the compiled model to call it
        compiled_models.append(compile_for_eval(module))
        return compiled_models[-1]

    monkeypatch.setattr(vision_evaluate, "compile_for_eval", compile_and_keep)
    eager = vision_evaluate.main([*settings, "compile=false"])
    assert not compiled_models
    torch._dynamo.reset()  # another test's compiled ViT in this process would count as a first compile
    with torch._dynamo.config.patch(error_on_recompile=True):  # the last batch must not recompile
        compiled = vision_evaluate.main([*settings, "compile=true"])
    assert len(compiled_models) == 1 and compiled["images"] == eager["images"] == 10
    # the same images right and wrong: Top-1 and Top-5 counts equal exactly
    assert round(compiled["top1"] * 10 / 100) == round(eager["top1"] * 10 / 100)
    assert compiled["top1"] == eager["top1"] and compiled["top5"] == eager["top5"]
    assert abs(compiled["loss"] - eager["loss"]) <= 1e-5 * max(1.0, abs(eager["loss"]))  # float32 rounding
    last = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the padded last batch's logits, cut back, are eager's to 1e-5
        torch.testing.assert_close(compiled_models[0].eval()(vision_evaluate.pad_batch(last, 4))[:2], model(last),
                                   atol=1e-5, rtol=1e-5)
