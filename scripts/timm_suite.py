"""timm's own model test-suite (``tests/test_models.py`` of the installed timm's sdist) on our registered DeiTs.

timm's file parametrizes every test over ``timm.list_models(...)``; this module is a pytest plugin that, before
that file is collected, imports :mod:`vision` (registering our models) and narrows ``list_models`` and
``list_pretrained`` to the chosen names, so each test of timm's runs on our models exactly as on its own, and
deselects the tests written for one named timm model and those that download pretrained weights. ``deit_tiny_patch16_224``, timm's own DeiT, is the control.

    python -m scripts.timm_suite                                  # every registered DeiT, and the control
    python -m scripts.timm_suite --models 'deit_tiny_*'           # fnmatch patterns, comma-separated
    python -m scripts.timm_suite --models deit_tiny_siamese_patch16_224 -- -x -k torchscript   # pytest options

The sdist of the installed timm version is fetched once from PyPI (``pip download --no-binary :all:``) into
``--cache`` (default ``.cache/timm-sdist``). The table at the end counts passed / failed / skipped per model.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tarfile
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
CONTROL = "deit_tiny_patch16_224"
# Tests of downloading pretrained weights from the Hugging Face hub, not of a model's code.
NEEDS_HUB = ("test_model_inference", "test_model_load_pretrained", "test_model_features_pretrained")
DEFAULT_CACHE = ROOT / ".cache" / "timm-sdist"


def registered_models() -> List[str]:
    """Every DeiT name :mod:`vision.deit` registers with timm."""
    from vision.deit import MODEL_NAMES

    return list(MODEL_NAMES)


def default_models() -> List[str]:
    return registered_models() + [CONTROL]


def fetch_timm_tests(version: Optional[str] = None, cache: Path = DEFAULT_CACHE) -> Path:
    """The ``timm-<version>`` folder of timm's sdist (its ``tests/`` and ``pyproject.toml``), downloaded once.

    Raises ``RuntimeError`` naming the pip command when PyPI cannot be reached.
    """
    if version is None:
        import timm

        version = timm.__version__
    root = Path(cache) / f"timm-{version}"
    test_file = root / "tests" / "test_models.py"
    if test_file.exists():
        return root
    Path(cache).mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--quiet",
               f"timm=={version}", "-d", str(cache)]
    done = subprocess.run(command, capture_output=True, text=True)
    archive = Path(cache) / f"timm-{version}.tar.gz"
    if done.returncode != 0 or not archive.exists():
        raise RuntimeError(f"could not fetch timm {version}'s sdist from PyPI ({' '.join(command)}):\n"
                           f"{done.stderr.strip()[-2000:]}")
    wanted = (f"timm-{version}/pyproject.toml", f"timm-{version}/tests/")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(wanted) and (m.isfile() or m.isdir())]
        tar.extractall(cache, members=members, filter="data")
    if not test_file.exists():
        raise RuntimeError(f"{archive} has no tests/test_models.py")
    return root


def run_suite(models: Sequence[str], pytest_args: Sequence[str] = (), cache: Path = DEFAULT_CACHE,
              summary: Optional[Path] = None, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run timm's ``test_models.py`` on ``models`` (names or fnmatch patterns) in a fresh interpreter."""
    root = fetch_timm_tests(cache=cache)
    command = [sys.executable, "-m", "pytest", str(root / "tests" / "test_models.py"), "-p", "scripts.timm_suite",
               "-c", str(root / "pyproject.toml"), "--rootdir", str(root), "-p", "no:cacheprovider",
               "--import-mode=importlib", "--timm-models", ",".join(models), "-q", *pytest_args]
    if summary is not None:
        command += ["--timm-summary", str(summary)]
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(command, cwd=ROOT, env=env)


# ----------------------------------------------------------------------------- the pytest plugin

_selected: Optional[set] = None
_model_of: Dict[str, str] = {}
_counts: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
_outcomes: Dict[str, Dict[str, str]] = defaultdict(dict)


def pytest_addoption(parser):
    group = parser.getgroup("timm-suite")
    group.addoption("--timm-models", default=None,
                    help="comma-separated model names or fnmatch patterns to run timm's tests on "
                         "(default: every DeiT vision.deit registers, and deit_tiny_patch16_224)")
    group.addoption("--timm-summary", default=None, help="write the per-model counts to this JSON file")


def _narrow(function):
    def narrowed(*args, **kwargs):
        return [name for name in function(*args, **kwargs) if name.split(".")[0] in _selected]

    narrowed.__wrapped__ = function
    return narrowed


def pytest_configure(config):
    global _selected
    import timm

    import vision  # noqa: F401  (registers our models before timm's test file lists them)

    option = config.getoption("--timm-models")
    patterns = option.split(",") if option else default_models()
    everything = timm.list_models()
    _selected = {name for name in everything if any(fnmatch.fnmatch(name, p) for p in patterns)}
    if not _selected:
        raise ValueError(f"--timm-models {option!r} matches no registered model")
    timm.list_models = _narrow(timm.list_models)
    timm.list_pretrained = _narrow(timm.list_pretrained)
    config.addinivalue_line("markers", "timeout(seconds): timm's per-test time limit (needs pytest-timeout)")


def _model_name(item) -> Optional[str]:
    """The model a test runs on, without its pretrained tag (``deit_tiny_patch16_224.fb_in1k``)."""
    callspec = getattr(item, "callspec", None)
    name = callspec.params.get("model_name") if callspec is not None else None
    return name.split(".")[0] if isinstance(name, str) else None


def pytest_collection_modifyitems(config, items):
    """Keep only the tests parametrized over the chosen models."""
    keep, drop = [], []
    for item in items:
        model = _model_name(item)
        if model in _selected and item.originalname not in NEEDS_HUB:
            _model_of[item.nodeid] = model
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_logreport(report):
    model = _model_of.get(report.nodeid)
    if model is None:
        return
    test = report.nodeid.split("::")[-1].split("[")[0]
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _counts[model][report.outcome] += 1
        _outcomes[model][test] = report.outcome


def pytest_terminal_summary(terminalreporter, config):
    if not _counts:
        return
    write = terminalreporter.write_line
    write("")
    write(f"timm {__import__('timm').__version__} tests/test_models.py, per model:")
    write(f"{'model':<36} {'passed':>7} {'failed':>7} {'skipped':>8}  failing tests")
    for model in sorted(_counts):
        c = _counts[model]
        failed = [test for test, outcome in _outcomes[model].items() if outcome == "failed"]
        write(f"{model:<36} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8}  {', '.join(failed)}")
    path = config.getoption("--timm-summary")
    if path:
        Path(path).write_text(json.dumps({m: {**_counts[m], "tests": _outcomes[m]} for m in _counts}, indent=1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None,
                        help="comma-separated names or fnmatch patterns (default: every registered DeiT and "
                             f"{CONTROL})")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the sdist is kept")
    parser.add_argument("--summary", type=Path, default=None, help="write the per-model counts to this JSON file")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    models = args.models.split(",") if args.models else default_models()
    try:
        done = run_suite(models, args.pytest_args, cache=args.cache, summary=args.summary)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
