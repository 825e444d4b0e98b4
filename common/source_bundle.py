"""One self-contained Python file holding the definitions some objects need, gathered from the project's modules.

An exported model must run where this project is not installed (a diffusers pipeline folder loaded with
``trust_remote_code=True`` imports one module file of the folder, not a package). :func:`bundle_source` writes that
file from the project's own source at export time, so the shipped code is the code that was tested, never a second
copy kept by hand: starting from the named objects it takes every top-level definition (function, class, constant)
they refer to, transitively through the project's modules (``common``, ``diffusion``, ``vision``), in an order that
runs; imports of other packages (torch, timm, diffusers, ...) are kept as imports, and imports of project modules
inside functions are dropped (their names are defined in the file).

    source = bundle_source([("diffusion.pipeline", "DiTSamplingPipeline")], title="DiT sampling pipeline")
"""
from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

PROJECT_PACKAGES = ("common", "diffusion", "vision")


class BundleError(RuntimeError):
    """The objects cannot be gathered into one file (two different definitions of one name, an unknown name)."""


def _is_project(module: str) -> bool:
    return module.split(".")[0] in PROJECT_PACKAGES


@dataclass
class _Module:
    """A project module's top level: the statement defining each name, and what each imported name refers to."""

    name: str
    source: str
    lines: List[str]
    definitions: Dict[str, ast.stmt] = field(default_factory=dict)
    imports: Dict[str, Tuple[str, Optional[str]]] = field(default_factory=dict)  # local -> (module, name or None)
    effects: List[ast.stmt] = field(default_factory=list)  # top-level calls, e.g. a registry's registrations


def _bound_names(node: ast.stmt) -> Set[str]:
    """Names a top-level statement binds (a def, a class, assignment targets; inside if/try blocks too)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.If, ast.Try, ast.With)):
        inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                 *[s for h in getattr(node, "handlers", []) for s in h.body]]
        return {name for s in inner for name in _bound_names(s)}
    return set()


def _read_module(name: str) -> _Module:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise BundleError(f"module {name} not found")
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    module = _Module(name, source, source.splitlines())
    package = name if spec.submodule_search_locations else name.rpartition(".")[0]
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                module.imports[local] = (alias.name if alias.asname else local, None)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "__future__":
                continue
            source_module = _absolute(node, package)
            for alias in node.names:
                module.imports[alias.asname or alias.name] = (source_module, alias.name)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            module.effects.append(node)
        else:
            for bound in _bound_names(node):
                module.definitions[bound] = node
    return module


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def _referenced_names(node: ast.AST) -> Set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _inner_project_imports(node: ast.stmt) -> List[ast.ImportFrom]:
    """Imports of project modules inside a definition (lazy imports): dropped from the bundle."""
    return [n for n in ast.walk(node) if n is not node and isinstance(n, ast.ImportFrom) and n.module
            and not n.level and _is_project(n.module)]


def bundle_source(roots: Sequence[Tuple[str, Optional[str]]], title: str) -> str:
    """The source of one module defining ``roots`` (``(module, name)`` pairs) and everything they refer to;
    ``(module, None)`` takes the module's top-level calls (registrations) and what they refer to."""
    modules: Dict[str, _Module] = {}

    def module(name: str) -> _Module:
        if name not in modules:
            modules[name] = _read_module(name)
        return modules[name]

    chosen: Dict[Tuple[str, int], Tuple[str, ast.stmt]] = {}  # (module, line) -> (module, statement)
    defined_by: Dict[str, Tuple[str, str]] = {}  # name in the bundle -> (module, its source text)
    external: Dict[str, str] = {}  # name in the bundle -> its import line
    module_order: List[str] = []
    todo = [(m, n) for m, n in roots]
    seen: Set[Tuple[str, str]] = set()
    while todo:
        module_name, name = todo.pop()
        if (module_name, name) in seen:
            continue
        seen.add((module_name, name))
        mod = module(module_name)
        if name is None:
            for node in mod.effects:
                chosen[(module_name, node.lineno)] = (module_name, node)
                todo += [(module_name, ref) for ref in _referenced_names(node)]
            if module_name not in module_order:
                module_order.append(module_name)
        elif name in mod.definitions:
            node = mod.definitions[name]
            text = _statement_text(mod, node)
            for bound in _bound_names(node):
                if bound in defined_by and defined_by[bound][1] != text:
                    raise BundleError(f"{bound} is defined differently in {defined_by[bound][0]} and {module_name}")
                defined_by.setdefault(bound, (module_name, text))
            key = (module_name, node.lineno)
            if key in chosen:
                continue
            chosen[key] = (module_name, node)
            if module_name not in module_order:
                module_order.append(module_name)
            for inner in _inner_project_imports(node):
                for alias in inner.names:
                    if alias.asname and alias.asname != alias.name:
                        raise BundleError(f"{module_name}: `from {inner.module} import {alias.name} as "
                                          f"{alias.asname}` inside a definition cannot be bundled; import it plainly")
                    todo.append((inner.module, alias.name))
            todo += [(module_name, ref) for ref in _referenced_names(node) if ref != name]
        elif name in mod.imports:
            source_module, source_name = mod.imports[name]
            if source_name is not None and _is_project(source_module):
                if source_name != name:
                    raise BundleError(f"{module_name} imports {source_module}.{source_name} as {name}: bundle it "
                                      "under its own name")
                todo.append((source_module, source_name))
            elif not _is_project(source_module):
                line = (f"import {source_module}" if source_name is None and source_module == name else
                        f"import {source_module} as {name}" if source_name is None else
                        f"from {source_module} import {source_name}" + (f" as {name}" if name != source_name else ""))
                if external.setdefault(name, line) != line:
                    raise BundleError(f"{name} is imported as `{external[name]}` and as `{line}`")
        # anything else is a builtin or a local name of some function: nothing to gather
    order = _module_order(module_order, modules)
    body: List[str] = []
    for m in order:
        for line in sorted(k[1] for k in chosen if k[0] == m):
            text = _statement_text(modules[m], chosen[(m, line)][1])
            if text not in body:  # e.g. ``Tensor = torch.Tensor``, in several modules: once, where first needed
                body.append(text)
    sources = ", ".join(order)
    header = (f'"""{title}.\n\nGenerated from the SiameseNorm project\'s modules ({sources}) by its export: the same '
              f'code, gathered into one file that needs\nonly the packages imported below."""\n'
              "from __future__ import annotations\n\n")
    imports = sorted(external.values(), key=lambda line: (line.startswith("from"), line))
    return header + "\n".join(imports) + "\n\n\n" + "\n\n\n".join(body) + "\n"


def _module_order(used: List[str], modules: Dict[str, _Module]) -> List[str]:
    """The modules in an order their top levels can run in: each after the project modules it imports at its top
    level (the order Python itself imports them)."""
    order: List[str] = []

    def visit(name: str, path: Tuple[str, ...] = ()) -> None:
        if name in order or name in path:
            return
        for source_module, _ in modules[name].imports.values():
            if source_module in modules:
                visit(source_module, path + (name,))
        order.append(name)

    for name in used:
        visit(name)
    return [name for name in order if name in used]


def _statement_text(module: _Module, node: ast.stmt) -> str:
    """The statement's source lines (decorators included), without imports of project modules inside it."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    drop = {i for inner in _inner_project_imports(node) for i in range(inner.lineno, inner.end_lineno + 1)}
    lines = [line for i, line in enumerate(module.lines[first - 1: node.end_lineno], first) if i not in drop]
    return "\n".join(lines)
