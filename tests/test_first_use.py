"""What a first try of a documented command meets when something is missing or misspelt: one line naming the problem
and the fix (the option to set, the file to pass), never a number from no weights, a traceback or a silent export.
Each command runs as its entry point's ``main(argv)`` in this process (``tests/refusals.py``)."""
from pathlib import Path

import pytest

from common.config import load_config, save_config
from tests.refusals import refusal

ROOT = Path(__file__).resolve().parents[1]


def deit_run_folder(run: Path, *files: str) -> Path:
    """A vision.train run folder as the evaluator reads it: its config.yaml, and ``files`` (empty: never read)."""
    from vision.train import TrainConfig

    run.mkdir(parents=True, exist_ok=True)
    save_config(load_config(TrainConfig, ROOT / "configs/fmnist_deit_siamese.yaml", [f"train.output_dir={run}"]),
                run / "config.yaml")
    for name in files:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).touch()
    return run


def test_an_evaluation_without_weights_is_refused_naming_the_runs_weights_files(tmp_path, capsys):
    from vision.evaluate import main

    run = deit_run_folder(tmp_path / "run")
    line = refusal(main, ["--config", run / "config.yaml"], capsys)
    assert line.startswith("error: no weights to evaluate: without checkpoint= (and model.pretrained=false) the model "
                           "would be scored at its random initialisation; pass checkpoint=FILE"), line
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "step_000000004.pt").touch()  # an unfinished run: its newest checkpoint
    line = refusal(main, ["--config", run / "config.yaml"], capsys)
    assert line.endswith(f"pass checkpoint={run / 'checkpoints' / 'step_000000004.pt'} (the unfinished run's newest "
                         "checkpoint)"), line
    for name in ("model.safetensors", "ema.safetensors"):
        (run / name).touch()
    line = refusal(main, ["--config", run / "config.yaml"], capsys)
    assert line.endswith(f"pass checkpoint={run / 'model.safetensors'} or checkpoint={run / 'ema.safetensors'} (the "
                         "run's final weights, raw or EMA)"), line
    # a config copied elsewhere: the run is found by its train.output_dir
    (tmp_path / "copy.yaml").write_text((run / "config.yaml").read_text())
    assert f"checkpoint={run / 'model.safetensors'}" in refusal(main, ["--config", tmp_path / "copy.yaml"], capsys)


# ------------------------------------------------------------------------------------------- exports

@pytest.mark.fashion_mnist
def test_vision_export_names_its_own_flag_for_a_run_without_an_ema_and_an_offline_push_is_one_line(tmp_path, capsys,
                                                                                                   monkeypatch):
    import huggingface_hub

    from tests.test_export import train_tiny
    from vision.export import main

    train_tiny(tmp_path / "paused", "optim.epochs=2", "train.stop_at_step=1", "train.ema_decay=null")
    line = refusal(main, ["--run", tmp_path / "paused", "--out", tmp_path / "x", "--weights", "ema",
                          "--allow-unfinished"], capsys)
    assert line == (f"error: {tmp_path / 'paused'} was trained without an EMA (train.ema_decay is null): export its raw "
                    "weights with --weights model"), line
    assert not (tmp_path / "x").exists()

    train_tiny(tmp_path / "done", "optim.epochs=1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never an upload from a test
    line = refusal(main, ["--run", tmp_path / "done", "--out", tmp_path / "hub", "--push-to-hub", "someone/deit"],
                   capsys)
    assert line.startswith("error: --push-to-hub someone/deit: OfflineModeIsEnabled: ") and line.endswith(
        f"(the folder {tmp_path / 'hub'} is written; upload it later with `hf upload someone/deit {tmp_path / 'hub'}`)")
    assert {p.name for p in (tmp_path / "hub").iterdir()} == {"config.json", "model.safetensors", "README.md"}
    card = (tmp_path / "hub" / "README.md").read_text()  # the model card: timm knows the model after `import vision`
    assert "import timm, vision" in card and 'timm.create_model("hf-hub:someone/deit", pretrained=True)' in card


@pytest.mark.fashion_mnist
def test_diffusion_export_refuses_an_unfinished_run_as_vision_export_does(tmp_path, capsys):
    from diffusion.export import main
    from diffusion.train import TrainConfig, train

    run = tmp_path / "run"
    train(load_config(TrainConfig, ROOT / "configs/fmnist_dit_siamese.yaml", [
        "model.kwargs={hidden_size: 32, depth: 1, num_heads: 2}", "data.num_workers=0", "train.tensorboard=false",
        "train.threads=1", "train.sample_every=0", "data.max_samples=16", "optim.batch_size=8", "optim.steps=4",
        "train.stop_at_step=1", f"train.output_dir={run}"]))
    for checkpoint in (run / "ema.safetensors", run / "checkpoints" / "step_000000001.pt"):
        line = refusal(main, ["--checkpoint", checkpoint, "--out", tmp_path / "out", "--quiet"], capsys)
        assert line == (f"error: {run} is not finished (it is at step 1 of 4; no final_metrics.json for it): finish it "
                        f"by rerunning diffusion.train with the same config, or export its {checkpoint.name} as it is "
                        "with --allow-unfinished"), line
    assert not (tmp_path / "out").exists()
    result = main(["--checkpoint", str(run / "ema.safetensors"), "--out", str(tmp_path / "out"), "--allow-unfinished",
                   "--quiet"])
    assert (result["finished"], result["step"], result["total_steps"]) == (False, 1, 4)
    assert (tmp_path / "out" / "config.json").is_file()


# ------------------------------------------------------------------------------------------- names

def test_a_misspelt_model_name_gets_the_nearest_name_as_a_misspelt_key_does(tmp_path, capsys):
    import torch

    from diffusion.export import main as export_main
    from diffusion.train import main as dit_main
    from vision.train import main as deit_main

    line = refusal(deit_main, ["--config", ROOT / "configs/fmnist_deit_siamese.yaml",
                               "model.name=deit_tiny_siamse_patch16_224"], capsys)
    assert "unknown model 'deit_tiny_siamse_patch16_224' (did you mean 'deit_tiny_siamese_patch16_224'?)" in line
    line = refusal(dit_main, ["--config", ROOT / "configs/fmnist_dit_siamese.yaml", "model.name=DiT-XL2"], capsys)
    assert "model.name='DiT-XL2' is not a DiT (did you mean 'DiT-XL/2'?); choose one of DiT-S/2" in line, line
    torch.save({"x_embedder.proj.weight": torch.zeros(1)}, tmp_path / "plain.pt")  # a state dict that names no model
    line = refusal(export_main, ["--checkpoint", tmp_path / "plain.pt", "--out", tmp_path / "out", "--model", "DiT-B2",
                                 "--image-size", "256"], capsys)
    assert "--model 'DiT-B2' is not a DiT (did you mean 'DiT-B/2'?)" in line, line
    from diffusion.sample import main as sample_main

    line = refusal(sample_main, ["--checkpoint", tmp_path / "plain.pt", "--grid", tmp_path / "g.png", "--model",
                                 "LightningDiT-XL1", "--image-size", "256"], capsys)
    assert "--model 'LightningDiT-XL1' is not a DiT (did you mean 'LightningDiT-XL/1'?)" in line, line


# ------------------------------------------------------------------------------------------- docs

def test_the_dit_parameter_tables_give_every_topology_they_name_as_the_models_count_it():
    """docs/models.md's DiT tables: each cell's count is the model's (frozen pos_embed included), and the multi-stream
    and cross-layer designs are there too."""
    import re

    import torch

    from diffusion.models import DiT_models

    text = (ROOT / "docs/models.md").read_text()
    section = text[text.index("## DiT (`diffusion/models.py`)"):text.index("## `recompute_norms`")]
    tables = re.findall(r"^\| model \|(.*)\|\n\|[-|]+\|\n((?:\|.*\|\n)+)", section, flags=re.M)
    counted = {}
    for header, rows in tables:
        topologies = [t.strip() for t in header.split("|")]
        for row in rows.strip().splitlines():
            name, *cells = [c.strip() for c in row.strip("|").split("|")]
            for topology, cell in zip(topologies, cells):
                with torch.device("meta"):
                    model = DiT_models[name](topology=topology)
                assert int(cell.split()[0].replace(",", "")) == sum(p.numel() for p in model.parameters()), \
                    (name, topology)
                counted.setdefault(topology, set()).add(name)
    models = {"DiT-S/2", "DiT-B/2", "DiT-L/4", "DiT-XL/2"}
    assert {t for t, names in counted.items() if names == models} >= {"pre", "siamese", "post", "hc", "mhc", "attnres",
                                                                       "attnres_block"}


# ------------------------------------------------------------------------------------------- distillation

@pytest.mark.fashion_mnist
def test_a_teacher_file_that_does_not_fit_is_one_short_line_naming_both_settings(tmp_path, capsys):
    """Another class count (a head of another shape), or DeiT's default teacher regnety_160 given a ResNet file
    (hundreds of missing and unexpected keys): a line naming distill.teacher and distill.teacher_weights, counts and a
    few keys, not a thousand characters of keys and a Python-only strict=False."""
    import timm
    import torch

    from vision.train import main

    torch.save({"model": timm.create_model("regnety_002", num_classes=3).state_dict()}, tmp_path / "three.pth")
    torch.save({"model": timm.create_model("resnet10t", num_classes=10).state_dict()}, tmp_path / "resnet.pth")
    run = ["--config", ROOT / "configs/fmnist_deit_siamese.yaml", "model.name=deit_tiny_siamese_distilled_patch16_224",
           "model.kwargs={embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}", "data.input_size=32",
           "data.num_workers=0", "data.max_train_samples=16", "data.max_val_samples=20", "optim.batch_size=8",
           "train.tensorboard=false", "train.threads=1", f"train.output_dir={tmp_path / 'run'}", "distill.type=hard",
           "distill.alpha=0.5"]
    line = refusal(main, [*run, "distill.teacher=regnety_002", f"distill.teacher_weights={tmp_path / 'three.pth'}"],
                   capsys)
    assert line == (f"error: distill.teacher_weights={tmp_path / 'three.pth'} does not fit distill.teacher=regnety_002 "
                    "with 10 classes (data.num_classes): 2 keys of another shape (head.fc.weight: checkpoint (3, 368) "
                    "vs model (10, 368), head.fc.bias: checkpoint (3,) vs model (10,)). Give that model's weights for "
                    "these classes, or name the model of this file in distill.teacher (and its arguments in "
                    "distill.teacher_kwargs)"), line
    line = refusal(main, [*run, "distill.teacher=regnety_160", f"distill.teacher_weights={tmp_path / 'resnet.pth'}"],
                   capsys)
    assert "does not fit distill.teacher=regnety_160 with 10 classes (data.num_classes): 428 missing keys (" in line
    assert "; 86 unexpected keys (conv1.0.weight, " in line and "strict=False" not in line and len(line) < 500, line
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------------------------------- --print-config

@pytest.mark.parametrize("trainer, recipe", [("vision.train", "deit_tiny_siamese.yaml"),
                                             ("diffusion.train", "dit_b2_siamese.yaml")])
def test_print_config_prints_a_recipe_without_its_data_path_and_says_what_a_run_still_needs(trainer, recipe, capsys):
    """data.path is needed to run, not to read the resolved recipe: --print-config prints it (exit 0), its last line a
    YAML comment naming the missing setting; a run of the same command is refused with that line."""
    import importlib

    import yaml

    main = importlib.import_module(trainer).main
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(ROOT / "configs" / recipe), "--print-config"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    assert yaml.safe_load(out)["data"]["path"] is None and yaml.safe_load(out)["optim"]["batch_size"] >= 256
    assert out.splitlines()[-1].startswith("# to run it, also: data.path is required for dataset="), out[-300:]
    line = refusal(main, ["--config", ROOT / "configs" / recipe], capsys)
    assert line.startswith("error: data.path is required for dataset="), line
