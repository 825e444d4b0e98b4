"""The package arrows the layout promises: common/ serves both families and imports neither; vision/ and
diffusion/ never import each other; scripts/ holds entry points that no module imports (only tests run them). A
crossed arrow is how a second copy of an idea starts. And every relative link of the README and docs/ resolves, so a
newcomer following one finds the page and section it names."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"common": {"vision", "diffusion"}, "vision": {"diffusion"}, "diffusion": {"vision"}}


def imported_packages(path: Path) -> set:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):  # function-level (lazy) imports count too
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_layout(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    crossed = {str(f.relative_to(ROOT)): sorted(imported_packages(f) & FORBIDDEN[package]) for f in files}
    assert not {f: p for f, p in crossed.items() if p}, f"{package}/ must not import {sorted(FORBIDDEN[package])}"


def test_no_module_imports_an_entry_point_of_scripts():
    files = [f for f in sorted(ROOT.rglob("*.py")) if f.relative_to(ROOT).parts[0] not in ("tests", ".venv")
             and not any(part.startswith(".") for part in f.relative_to(ROOT).parts)]
    assert any(f.parent.name == "scripts" for f in files) and any(f.parent.name == "benchmarks" for f in files)
    importers = [str(f.relative_to(ROOT)) for f in files if "scripts" in imported_packages(f)]
    assert not importers, "move what these import from scripts/ into a package (scripts/ keeps entry points)"


def module_graph() -> dict:
    """``{module: the project modules it imports}`` over every package (lazy imports count; ``if TYPE_CHECKING:``
    blocks, which never run, do not)."""
    files = {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
             for f in ROOT.rglob("*.py") if f.relative_to(ROOT).parts[0] not in ("tests", ".venv")
             and not any(part.startswith(".") for part in f.relative_to(ROOT).parts)}
    graph = {}
    for name, f in files.items():
        tree = ast.parse(f.read_text(), filename=str(f))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
        targets = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.update([node.module] + [f"{node.module}.{alias.name}" for alias in node.names])
        graph[name] = (targets & set(files)) - {name}
    return graph


def test_no_import_circle():
    graph = module_graph()
    assert "diffusion.evaluation.metrics" in graph and "comparison.report" in graph

    def reaches(start, goal, seen):
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in graph[start])

    circles = sorted(name for name in graph if reaches(name, name, set()))
    assert not circles, f"modules on an import circle: {circles}"


def test_the_scan_sees_lazy_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from diffusion.latents import load_vae\n")
    assert imported_packages(f) == {"diffusion"}


def _prose(page: Path) -> str:
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a `# comment` in a code block is no heading


def heading_anchors(page: Path) -> set:
    """GitHub's anchors: the heading lower-cased, punctuation other than - and _ dropped, spaces as -."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+\s+(.*)$", _prose(page), flags=re.M)}


def broken_links(page: Path) -> list:
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = page.parent / path if path else page
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in heading_anchors(target)):
            broken.append(link)
    return broken


def test_every_relative_link_of_the_readme_and_docs_resolves(tmp_path):
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(pages) > 10
    assert {str(p.relative_to(ROOT)): b for p in pages if (b := broken_links(p))} == {}
    page = tmp_path / "page.md"
    page.write_text("# A heading\n[ok](#a-heading) [gone](missing.md) [no section](#no-such) [web](https://x.org/y)\n"
                    "```bash\n# not a heading\n```\n[code](#not-a-heading)\n")
    assert broken_links(page) == ["missing.md", "#no-such", "#not-a-heading"]
