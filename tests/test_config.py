"""YAML recipes -> validated dataclasses: inheritance, overrides, and the errors a user sees."""
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Literal, Optional, Tuple

import pytest
import yaml

from common.config import ConfigError, flatten, load_config, parse_overrides, save_config


@dataclass
class Optim:
    lr: float = 1e-3
    batch_size: int = 64
    betas: Tuple[float, float] = (0.9, 0.999)
    clip_grad: Optional[float] = None


@dataclass
class Schema:
    name: str = "x"
    mode: Literal["a", "b"] = "a"
    flag: bool = False
    scale: List[float] = field(default_factory=lambda: [0.08, 1.0])
    kwargs: Dict[str, object] = field(default_factory=dict)
    optim: Optim = field(default_factory=Optim)


def write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_base_chain_and_overrides(tmp_path):
    write(tmp_path / "base.yaml", {"name": "base", "optim": {"lr": 5.0e-4, "batch_size": 1024}})
    child = write(tmp_path / "child.yaml", {"base": "base.yaml", "optim": {"batch_size": 256}})
    cfg = load_config(Schema, child, ["optim.clip_grad=1", "flag=true", "scale=[0.5, 1]", "kwargs.depth=2"])
    assert cfg.name == "base" and cfg.optim.lr == 5e-4 and cfg.optim.batch_size == 256
    assert cfg.optim.clip_grad == 1.0 and isinstance(cfg.optim.clip_grad, float)
    assert cfg.flag is True and cfg.scale == [0.5, 1.0] and cfg.kwargs == {"depth": 2}
    assert cfg.optim.betas == (0.9, 0.999)


def test_yaml11_exponent_string_is_a_float(tmp_path):
    # PyYAML reads `5e-4` (no dot) as a string; a float field must still accept it.
    (tmp_path / "c.yaml").write_text("optim:\n  lr: 5e-4\n")
    assert load_config(Schema, tmp_path / "c.yaml").optim.lr == 5e-4


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(Schema, write(tmp_path / "c.yaml", {"optim": {"lrr": 1.0}}))
    msg = str(err.value)
    assert "'lrr'" in msg and "did you mean 'lr'" in msg and "lr, batch_size, betas, clip_grad" in msg
    with pytest.raises(ConfigError, match="valid keys are: name, mode, flag"):
        load_config(Schema, None, ["nmae=y"])


@pytest.mark.parametrize("override, fragment", [
    ("optim.batch_size=1.5", "must be an integer"),
    ("flag=yes please", "true or false"),
    ("mode=c", "choose one of 'a', 'b'"),
    ("optim.betas=[0.9]", "must have 2 entries"),
    ("optim.lr=fast", "must be a number"),
    ("optim=3", "is a section"),
    ("name", "key=value"),
    ("kwargs={depth:4}", r"kwargs keys \['depth:4'\] have no value: in YAML write `\{depth: 4\}`"),
])
def test_type_errors(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(Schema, None, [override])


def test_missing_file_and_cycle(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Schema, tmp_path / "nope.yaml")
    write(tmp_path / "a.yaml", {"base": "b.yaml"})
    write(tmp_path / "b.yaml", {"base": "a.yaml"})
    with pytest.raises(ConfigError, match="cycle"):
        load_config(Schema, tmp_path / "a.yaml")


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(Schema, None, ["optim.lr=0.01", "kwargs.depth=3"])
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(Schema, path) == cfg
    assert flatten({"optim": {"lr": 1}, "a": 2}) == {"optim.lr": 1, "a": 2}
    assert parse_overrides(["a.b=null"]) == {"a": {"b": None}}


def test_recipe_numbers_have_no_code_default_and_a_missing_one_is_named():
    from vision.train import TrainConfig

    with pytest.raises(ConfigError, match=r"model.name is required and not set .* or pass model.name=VALUE"):
        load_config(TrainConfig, None, ["data.dataset=fashion_mnist"])
    with pytest.raises(ConfigError, match=r"optim.base_lr is required and not set .*add `base_lr: VALUE` under `optim:`"):
        load_config(TrainConfig, None, ["model.name=deit_tiny_patch16_224", "data.dataset=fashion_mnist",
                                        "optim.batch_size=8", "optim.lr_base_batch=8", "optim.epochs=1"])
    from common.config import schema_defaults

    defaults = schema_defaults(TrainConfig)
    assert "base_lr" not in defaults["optim"] and "name" not in defaults["model"]
    assert defaults["optim"]["warmup_epochs"] == 0.0 and defaults["augment"]["mixup"] == 0.0  # off


def test_help_lists_every_setting_with_default_and_meaning_and_print_config_resolves(capsys):
    import yaml

    from vision import train as deit_train

    with pytest.raises(SystemExit) as exit_info:
        deit_train.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "optim.base_lr (float > 0, required)  peak lr at batch lr_base_batch" in text
    assert "train.log_every (int >= 1, 50)  steps" in text
    assert "data.num_workers (int >= 0 or auto, auto)" in text and "augment.mixup_mode (batch|pair|elem, batch)" in text
    root = Path(__file__).resolve().parents[1]
    with pytest.raises(SystemExit) as exit_info:
        deit_train.main(["--config", str(root / "configs/deit_tiny_siamese.yaml"), "--print-config",
                         "data.path=/data/imagenet", "optim.epochs=3"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optim"]["epochs"] == 3 and printed["optim"]["batch_size"] == 1024  # recipe, base, override
    assert printed["augment"]["auto_augment"] == "rand-m9-mstd0.5-inc1" and printed["data"]["path"] == "/data/imagenet"


def test_a_dit_config_without_its_recipe_names_the_missing_key_and_the_recipe(tmp_path, capsys):
    """The recipe numbers live in configs/dit_recipe.yaml alone: without it nothing trains on code defaults."""
    from diffusion.train import TrainConfig

    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, None, ["model.name=DiT-S/4"])
    message = str(err.value)
    assert "\n" not in message and "model.topology is required and not set" in message
    assert "configs/dit_recipe.yaml" in message and "base: dit_recipe.yaml" in message
    own = write(tmp_path / "mine.yaml", {"model": {"name": "DiT-S/4", "topology": "pre", "learn_sigma": True,
                                                   "class_dropout_prob": 0.1}})
    with pytest.raises(ConfigError, match=r"^data.dataset is required and not set .*configs/dit_recipe.yaml sets it.* \(from .*mine.yaml"):
        load_config(TrainConfig, own)
    write(tmp_path / "dit_recipe.yaml", yaml.safe_load(open("configs/dit_recipe.yaml")))
    based = write(tmp_path / "based.yaml", {"base": "dit_recipe.yaml", "model": {"name": "DiT-S/4", "topology": "pre"},
                                            "data": {"path": "/latents"}})
    cfg = load_config(TrainConfig, based)
    assert (cfg.optim.lr, cfg.optim.batch_size, cfg.diffusion.num_timesteps, cfg.model.class_dropout_prob) == \
        (1e-4, 256, 1000, 0.1)
    from diffusion.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(own)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "data.dataset is required and not set" in err[0]
