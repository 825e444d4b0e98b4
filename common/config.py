"""YAML recipes -> typed, validated dataclasses, with ``key=value`` command-line overrides.

A config schema is a (possibly nested) dataclass. A field without a default is a recipe number the YAML must
give (an error names it otherwise); sections are built from their keys. Loading::

    cfg = load_config(TrainConfig, "configs/deit_tiny_siamese.yaml", ["optim.batch_size=256", "data.path=/in1k"])

* ``base: other.yaml`` at the top of a file inherits that file (path relative to the including file) and
  deep-merges this file over it, so each recipe number has one home. Bases may chain.
* Overrides are ``dotted.key=value``; the value is parsed as YAML (``1e-3``, ``true``, ``[0.08, 1.0]``,
  ``null``) and applied after the files.
* A key given twice in one mapping of a file is an error naming the key, the file and both lines (YAML's own
  rule; PyYAML would keep the last in silence).
* Validation: an unknown key raises :class:`ConfigError` listing the valid keys of its section (with a
  "did you mean" hint); values are type-checked against the dataclass annotations (``int``, ``float``,
  ``bool``, ``str``, ``Optional[...]``, ``List[...]``/``Tuple[...]``, ``Dict[str, ...]``, ``Literal[...]``,
  nested dataclasses). An ``int`` is accepted for a ``float`` field, and ``"5e-4"`` (which YAML 1.1 reads
  as a string) is accepted as a float; NaN and infinities are refused for every float.
* Every numeric setting declares its valid values next to its type, ``Annotated[int, Range(ge=1)]``: checked on
  load (the whole file before any section's own ``__post_init__`` checks), listed by ``--help``.
* Checks that need a library's registry (timm's model names, torch-fidelity's feature extractors) are a section's
  ``check_registered()`` method: loading skips them, so that a command line is parsed and refused without
  importing those libraries; :func:`check_registered` runs them (the trainers before any work, ``--print-config``).
  Settings only a run needs, which a printed config may lack (a data path), are a section's ``check_ready()``
  (:func:`check_ready`).

Also: :func:`config_to_dict` (plain nested dict), :func:`save_config` (write the resolved config next to a
run, so the run can be reproduced with ``--config <run>/config.yaml``), :func:`flatten` (dotted keys). Just over
500 lines: loading, merging, type checks and ranges are one unit that every command parses through.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Type, TypeVar, Union

import yaml

from common.cli import InputError
from common.durable import atomic_write_text

T = TypeVar("T")
BASE_KEY = "base"


class ConfigError(InputError):
    """A recipe file or override that does not fit the config schema."""


class MissingSettingError(ConfigError):
    """A key without a default (a recipe number) that neither the files nor the overrides set."""


class OutOfRangeError(ConfigError):
    """A value of the right type outside its setting's :class:`Range`."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid values of a numeric setting, declared next to its type and checked on load::

        batch_size: Annotated[int, Range(ge=1)]
        hflip: Annotated[float, Range(ge=0, le=1)]  # a probability

    ``ge``/``gt``/``le``/``lt``: the bounds (>=, >, <=, <); ``why``: why, added to the error. Written here because
    the config is plain dataclasses: a validation library would bring its own model of settings."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    why: str = ""

    def __contains__(self, value) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def __str__(self) -> str:
        """``>= 1``, ``> 0``, ``in [0, 1)``."""
        low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        high = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else None
        if low and high:
            return f"in {low}, {high}"
        if low:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        return ("<= " if high[-1] == "]" else "< ") + high[:-1] if high else "any number"

    def check(self, value, where: str) -> None:
        if value not in self:
            text = str(self)
            why = f": {self.why}" if self.why else ""
            raise OutOfRangeError(f"{where}={value!r} must {'lie' if text.startswith('in ') else 'be'} {text}{why}")


# ----------------------------------------------------------------------------- reading files

class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (YAML forbids it; PyYAML keeps the last)."""

    source = "the YAML text"

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` merges keys that this mapping may override
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise ConfigError(f"{self.source}: key {key!r} is given twice in one mapping (lines {seen[key]} and "
                                  f"{line}); keep one")
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str = "the YAML text"):
    """``yaml.safe_load`` that refuses duplicated keys, naming the key, ``source`` and the lines."""
    loader = _UniqueKeyLoader(text)
    loader.source = source
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: Union[str, os.PathLike], _chain: Sequence[Path] = ()) -> dict:
    """Read a YAML recipe and, recursively, the ``base:`` files it names; return the merged dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist (pass an existing YAML file to --config)")
    if path.resolve() in _chain:
        raise ConfigError(f"config files include each other in a cycle: {' -> '.join(map(str, _chain))} -> {path}")
    try:
        data = load_yaml(path.read_text(), str(path)) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of keys to values at the top level, got {type(data).__name__}")
    base = data.pop(BASE_KEY, None)
    if base is None:
        return data
    bases = [base] if isinstance(base, str) else base
    merged: dict = {}
    for b in bases:
        merged = deep_merge(merged, read_yaml(path.parent / b, (*_chain, path.resolve())))
    return deep_merge(merged, data)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's several-line message as one line: what is wrong, and where (1-based line and column)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    hint = " (YAML indents with spaces, never tabs)" if "'\\t'" in problem else ""
    return f"{problem}{where}{hint}"


def deep_merge(base: Mapping, override: Mapping) -> dict:
    """``override`` over ``base``; nested mappings merge key by key, everything else is replaced."""
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_overrides(overrides: Iterable[str]) -> dict:
    """``["optim.lr=1e-3", "data.path=/x"]`` -> nested dict, values parsed as YAML."""
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. optim.batch_size=256)")
        key, _, raw = item.partition("=")
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key; write section.key=value")
        try:
            value = load_yaml(raw, f"override {item!r}") if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(err)})") from None
        if re.search(r"(^|\s)#", raw) and not (isinstance(value, str) and "#" in value):
            value = raw.strip()  # YAML read a comment, but a command line has none: the whole text is the value
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override of {p!r}")
        node[leaf] = value
    return out


# ----------------------------------------------------------------------------- validation

def _coerce(value: Any, tp, where: str, construct: bool = True) -> Any:
    """Check ``value`` against annotation ``tp``; return it (converted where lossless). ``construct=False`` checks a
    section's keys, types and ranges without building it (see :func:`_build`)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or tp is object:
        return value
    if origin is typing.Annotated:
        coerced = _coerce(value, args[0], where, construct)
        for rule in args[1:]:
            if isinstance(rule, Range):
                rule.check(value if isinstance(value, (int, float)) and not isinstance(value, bool) else coerced, where)
        return coerced
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} is a section; give it a mapping of keys, got {value!r}")
        return _build(tp, value, where, construct)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where, construct)
            except OutOfRangeError:
                raise  # the value has one of the types, outside that type's range: that is the message
            except ConfigError as err:
                errors.append(str(err))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"{where}={value!r} must be {readable_type(tp)}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}={value!r} is not allowed; choose one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple, List, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where} must have {len(args)} entries, got {len(value)}: {value!r}")
            return tuple(_coerce(v, a, f"{where}[{i}]", construct) for i, (v, a) in enumerate(zip(value, args)))
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{where}[{i}]", construct) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        glued = [k for k, v in value.items() if v is None and ":" in str(k)]  # YAML reads {a:1} as {"a:1": None}
        if glued:
            example = str(glued[0]).replace(":", ": ", 1)
            raise ConfigError(f"{where} keys {glued} have no value: in YAML write `{{{example}}}` with a space after "
                              f"the colon (or {where}.KEY=VALUE on the command line)")
        val_tp = args[1] if args else Any
        return {str(k): _coerce(v, val_tp, f"{where}.{k}", construct) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{where} must be a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{where}={value!r} must be a finite number")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r} (quote it in YAML)")
        return value
    raise TypeError(f"config.py cannot validate annotation {tp!r} of {where}; use a simpler type")


def did_you_mean(word, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice nearest a misspelt ``word`` (difflib's ratio, >= 0.6), or nothing: the
    hint of every unknown name, a key or a model."""
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _build(cls: Type[T], values: Mapping, where: str = "", construct: bool = True) -> T:
    """The section ``cls`` from ``values``. ``construct=False``: only check keys, types and ranges, return the
    checked values; the root is checked that way first, so that a value out of range anywhere is refused before
    any section's ``__post_init__`` runs."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in values if k not in fields]
    if unknown:
        section = f"section {where!r}" if where else "the top level"
        k = unknown[0]
        raise ConfigError(f"unknown config key {k!r} in {section}{did_you_mean(k, fields)}; valid keys are: "
                          f"{', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        key = f"{where}.{name}" if where else name
        if name in values:
            value = values[name]
            if dataclasses.is_dataclass(hints[name]) and isinstance(value, Mapping):
                value = deep_merge(_section_default(f), value)  # a partly given section starts from its default
            kwargs[name] = _coerce(value, hints[name], key, construct)
        elif dataclasses.is_dataclass(hints[name]) and f.default_factory is dataclasses.MISSING:
            kwargs[name] = _build(hints[name], {}, key, construct)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            section = where.split(".")[-1] if where else None
            raise MissingSettingError(f"{key} is required and not set (the YAML recipes in configs/ give it): "
                                      + (f"add `{name}: VALUE` under `{section}:` in the recipe, " if section else "")
                                      + f"or pass {key}=VALUE")
    if not construct:
        return kwargs
    try:
        return cls(**kwargs)
    except InputError as err:  # a section's own check (a plain ValueError there is a bug, and keeps its traceback)
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"invalid config{' section ' + repr(where) if where else ''}: {err}") from err


def _section_default(f: dataclasses.Field) -> dict:
    """The values a section field starts from: its factory's (a schema may preset some), or none when the section has
    keys without a default (required recipe numbers)."""
    if f.default_factory is dataclasses.MISSING:
        return {}
    try:
        return config_to_dict(f.default_factory())
    except TypeError:  # required keys
        return {}


def schema_defaults(cls) -> dict:
    """The defaults of a config schema as a nested dict, without building it (required keys are absent)."""
    out = {}
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = schema_defaults(hints[f.name])
        elif f.default is not dataclasses.MISSING:
            out[f.name] = config_to_dict(f.default) if dataclasses.is_dataclass(f.default) else \
                (list(f.default) if isinstance(f.default, tuple) else f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = config_to_dict(f.default_factory())
    return out


def _build_root(cls: Type[T], values: Mapping) -> T:
    """:func:`_build`; a missing key also names the recipe that sets it (the schema's ``RECIPE``, if it has one)."""
    try:
        _build(cls, values, construct=False)
        return _build(cls, values)
    except MissingSettingError as err:
        recipe = getattr(cls, "RECIPE", None)
        if recipe is None:
            raise
        raise MissingSettingError(f"{err}; {recipe} sets it: start your YAML with `base: {Path(recipe).name}` (a path "
                                  "relative to your file)") from None


def from_dict(cls: Type[T], values: Mapping) -> T:
    """Build and validate a config dataclass from a plain (nested) dict."""
    return _build_root(cls, values)


def load_config(cls: Type[T], path: Optional[Union[str, os.PathLike]] = None, overrides: Iterable[str] = ()) -> T:
    """Read ``path`` (with its ``base:`` chain), apply ``key=value`` overrides, validate into ``cls``."""
    values = read_yaml(path) if path is not None else {}
    values = deep_merge(values, parse_overrides(overrides))
    try:
        return _build_root(cls, values)
    except ConfigError as err:
        origin = f" (from {path} and overrides {list(overrides)})" if path else ""
        raise ConfigError(f"{err}{origin}") from None


# ----------------------------------------------------------------------------- writing

def config_to_dict(cfg) -> dict:
    """Plain nested dict of a config dataclass (tuples become lists, so it round-trips through YAML)."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(cfg)


def flatten(d: Mapping, prefix: str = "") -> dict:
    """``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}`` (for trackers that want flat hyper-parameters)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def save_config(cfg, path: Union[str, os.PathLike]) -> Path:
    """Write the resolved config as YAML (atomically) so that the run can be repeated from it."""
    return atomic_write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def field_comments(cls) -> Dict[str, str]:
    """``{field: its trailing comment}`` from the dataclass sources (bases first): the settings' one-line meanings
    live next to their declarations, once."""
    import inspect

    comments: Dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for match in re.finditer(r"^    (\w+): [^\n#]*?#\s*(.+)$", source, flags=re.M):
            comments[match.group(1)] = match.group(2).strip()
    return comments


def readable_type(tp) -> str:
    """An annotation as a user writes the value: ``int >= 1 or null``, ``torch|dali``, ``[float, float]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        ranges = [str(rule) for rule in args[1:] if isinstance(rule, Range)]
        return " ".join([readable_type(args[0]), *ranges])
    if origin is Union:
        names = [readable_type(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is typing.Literal:
        return "|".join(str(a) for a in args)
    if origin in (tuple, list) and args:
        return "[" + ", ".join(readable_type(a) for a in args if a is not Ellipsis) + (", ...]" if origin is list or Ellipsis in args else "]")
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def describe_settings(schema) -> List[str]:
    """Every key of a schema (``section.key``, and the keys of the top level) with its type and valid values, its
    default (or "required": a recipe number) and its meaning."""
    lines = []
    hints = typing.get_type_hints(schema, include_extras=True)
    defaults = schema_defaults(schema)

    def describe(cls, prefix: str, values: dict, indent: str, only=None) -> None:
        comments, types = field_comments(cls), typing.get_type_hints(cls, include_extras=True)
        for f in dataclasses.fields(cls):
            if only is not None and f.name not in only:
                continue
            default = values.get(f.name, "required")
            shown = "required" if default == "required" else yaml.safe_dump(default, default_flow_style=True).strip()
            shown = shown.removesuffix("\n...").removesuffix(" ...")
            meaning = f"  {comments[f.name]}" if f.name in comments else ""
            lines.append(f"{indent}{prefix}{f.name} ({readable_type(types[f.name])}, {shown}){meaning}")

    sections = [f.name for f in dataclasses.fields(schema) if dataclasses.is_dataclass(hints[f.name])]
    describe(schema, "", defaults, "  ", only=[f.name for f in dataclasses.fields(schema) if f.name not in sections])
    for name in sections:
        lines.append(f"  {name}:")
        describe(hints[name], f"{name}.", defaults.get(name, {}), "    ")
    return lines


def _run_checks(cfg, method: str) -> None:
    """``cfg.<method>()`` of each section (depth first) and of the config itself, where they have it."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            _run_checks(value, method)
    check = getattr(cfg, method, None)
    if callable(check):
        check()


def check_registered(cfg) -> None:
    """Run the checks of a loaded config that need a library's registry: the ``check_registered()`` method of the
    config and of each of its sections, if they have one (they raise :class:`ConfigError`)."""
    _run_checks(cfg, "check_registered")


def check_ready(cfg) -> None:
    """Run the checks of settings that a run needs and a printed config may lack (a data path): the ``check_ready()``
    method of the config and of each of its sections. A trainer's command line runs them on load, ``--print-config``
    names what they find after the config instead of refusing it."""
    _run_checks(cfg, "check_ready")


def settings_epilog(schema, examples: Sequence[str] = ()) -> str:
    """The ``--help`` epilog of a config command line: every setting (:func:`describe_settings`) and examples."""
    lines = ["settings (key=value; type and valid values, default or 'required' (the recipe gives it), meaning):"]
    lines += describe_settings(schema)
    if examples:
        lines.append("\nexamples:\n" + "\n".join(f"  {e}" for e in examples))
    return "\n".join(lines)


def config_from_cli(schema: Type[T], argv: Optional[Sequence[str]], *, prog: str, description: str,
                    examples: Sequence[str]) -> T:
    """The trainers' command line, ``--config RECIPE.yaml [section.key=value ...]``, parsed and validated.

    ``--help`` lists every section and key of ``schema`` with its type, valid values, default and meaning;
    ``--print-config`` prints the resolved config (recipe, its bases and the overrides) and exits; a config error
    exits with status 2 and its message (rank 0 says it, :mod:`common.cli`). Nothing heavy is imported here: the
    checks that need a library's registry (:func:`check_registered`) are the caller's, before any work. Settings only a
    run needs (:func:`check_ready`: a data path) are checked here, except that ``--print-config`` prints a config
    without them and names them in a last comment line.
    """
    import argparse

    from common.cli import ArgumentParser, exit_input_error

    parser = ArgumentParser(prog=prog, description=description, epilog=settings_epilog(schema, examples),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML recipe (see configs/)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (recipe + bases + overrides, validated) as YAML and exit")
    parser.add_argument("overrides", nargs="*", help="section.key=value settings (values in YAML syntax)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(schema, args.config, args.overrides)
        if args.print_config:
            check_registered(cfg)
        else:
            check_ready(cfg)
    except ConfigError as err:
        exit_input_error(err)
    if args.print_config:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        try:
            check_ready(cfg)
        except ConfigError as err:
            print(f"# to run it, also: {err}")  # a YAML comment: the output stays a config file
        parser.exit(0)
    return cfg
