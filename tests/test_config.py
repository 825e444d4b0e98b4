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


# ------------------------------------------------------------------------------------------- duplicated keys

def test_a_key_given_twice_is_refused_naming_it_the_file_and_the_lines(tmp_path, capsys):
    base = tmp_path / "base.yaml"
    base.write_text("optim:\n  lr: 1.0\n  batch_size: 8\n  lr: 2.0\n")
    with pytest.raises(ConfigError, match=rf"^{base}: key 'lr' is given twice in one mapping \(lines 2 and 4\); keep one"):
        load_config(Schema, base)
    child = tmp_path / "child.yaml"
    child.write_text("base: ok.yaml\nname: a\nname: b\n")
    write(tmp_path / "ok.yaml", {"name": "x"})
    with pytest.raises(ConfigError, match=rf"{child}: key 'name' is given twice .*lines 2 and 3"):
        load_config(Schema, child)
    with pytest.raises(ConfigError, match=r"override 'kwargs=\{depth: 2, depth: 3\}': key 'depth' is given twice"):
        parse_overrides(["kwargs={depth: 2, depth: 3}"])
    same_values_elsewhere = tmp_path / "fine.yaml"  # the same key in two different mappings is no duplicate
    same_values_elsewhere.write_text("optim:\n  lr: 1.0\nkwargs:\n  lr: 1.0\n")
    assert load_config(Schema, same_values_elsewhere).kwargs == {"lr": 1.0}
    from vision import train as deit_train

    dup = tmp_path / "deit.yaml"
    dup.write_text(f"base: {Path(__file__).resolve().parents[1] / 'configs/fmnist_deit_siamese.yaml'}\n"
                   "augment:\n  mixup: 0.8\n  mixup: 0.0\n")
    with pytest.raises(SystemExit) as exit_info:
        deit_train.main(["--config", str(dup)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "key 'mixup' is given twice" in err, err


def test_the_shipped_recipes_have_no_key_twice():
    from common.config import load_yaml

    for recipe in sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")):
        load_yaml(recipe.read_text(), str(recipe))


# ------------------------------------------------------------------------------------------- ranges

def numeric_without_range(tp, where: str) -> list:
    """The int/float parts of an annotation that no Range governs (bools are not numbers here)."""
    import dataclasses
    import typing

    from common.config import Range

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return [] if any(isinstance(a, Range) for a in args[1:]) else numeric_without_range(args[0], where)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp, include_extras=True)
        return [x for f in dataclasses.fields(tp) for x in numeric_without_range(hints[f.name], f"{where}.{f.name}")]
    if tp in (int, float):
        return [where]
    return [x for a in args if a is not Ellipsis for x in numeric_without_range(a, where)]


def test_every_numeric_setting_declares_its_valid_values():
    from diffusion.config import TrainConfig as DiTConfig
    from vision.config import EvalConfig, TrainConfig as DeiTConfig

    for schema in (DeiTConfig, DiTConfig, EvalConfig):
        assert numeric_without_range(schema, schema.__name__) == []
    assert sorted(set(numeric_without_range(Schema, "Schema"))) == [  # the check can fail
        "Schema.optim.batch_size", "Schema.optim.betas", "Schema.optim.clip_grad", "Schema.optim.lr", "Schema.scale"]


@pytest.mark.parametrize("override, message", [
    ("data.input_size=0", "data.input_size=0 must be >= 1"),
    ("model.drop_path=5", "model.drop_path=5 must lie in [0, 1)"),
    ("augment.hflip=2", "augment.hflip=2 must lie in [0, 1]"),
    ("augment.mixup=-1", "augment.mixup=-1 must be >= 0"),
    ("optim.betas=[0.9, 1.0]", "optim.betas[1]=1.0 must lie in [0, 1)"),
    ("data.std=[0.2, 0, 0.2]", "data.std[1]=0 must be > 0"),
    ("train.ema_decay=1", "train.ema_decay=1 must lie in [0, 1)"),
    ("data.max_val_samples=0", "data.max_val_samples=0 must be >= 1"),
    ("train.keep_last=1", "train.keep_last=1 must be >= 2: when a run diverges"),
])
def test_a_value_outside_its_range_is_refused_on_load(override, message):
    from vision.config import TrainConfig

    recipe = Path(__file__).resolve().parents[1] / "configs/fmnist_deit_siamese.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, recipe, [override])
    assert str(err.value).startswith(message), str(err.value)


def test_the_edges_of_a_range_are_kept():
    from vision.config import TrainConfig

    recipe = Path(__file__).resolve().parents[1] / "configs/fmnist_deit_siamese.yaml"
    cfg = load_config(TrainConfig, recipe, ["augment.hflip=1", "augment.mixup=0", "model.drop_path=0.99",
                                            "data.crop_pct=1", "train.ema_decay=0", "data.num_workers=0"])
    assert (cfg.augment.hflip, cfg.augment.mixup, cfg.model.drop_path, cfg.data.crop_pct) == (1.0, 0.0, 0.99, 1.0)


def test_the_ranges_are_checked_before_any_section_builds():
    """A value out of range is reported even when another section's own check (here a model name timm does not
    know, checked only by check_registered) would fail too: the declarative ranges come first."""
    from common.config import check_registered
    from vision.config import TrainConfig

    recipe = Path(__file__).resolve().parents[1] / "configs/fmnist_deit_siamese.yaml"
    with pytest.raises(ConfigError, match="augment.mixup=-1 must be >= 0"):
        load_config(TrainConfig, recipe, ["model.kwargs={depth: null}", "augment.mixup=-1"])
    cfg = load_config(TrainConfig, recipe, ["model.name=deit_tiny_nosuch_patch16_224"])  # loads: no timm needed
    with pytest.raises(ConfigError, match="unknown model 'deit_tiny_nosuch_patch16_224'"):
        check_registered(cfg)
