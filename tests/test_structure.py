"""The package's shape: layers that import only downward, and public functions with type hints.

The layers are the folders of docs/architecture.md, top to bottom. A module may import its own
layer and those below it, never one above, not even inside a function or for type checking
alone: the import graph then has no cycle, and a layer can be read without those above it.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fedsim"
LAYERS = ["cli", "runs", "execution", "engine", "experiment", "fl", "algorithms", "models", "data", "results", "core"]


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield path, parts


def layer(parts) -> int | None:
    """The layer of fedsim.<parts[1]>...; None for the package itself (fedsim/__init__, __main__)."""
    name = parts[1] if len(parts) > 1 else ""
    return LAYERS.index(name) if name in LAYERS else None


def imported(path, parts):
    """(line, module) for every fedsim module ``path`` imports, relative imports resolved."""
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "fedsim":
                yield node.lineno, tuple(name.split("."))


def test_the_top_level_holds_the_commands_and_the_layers_only():
    files = {p.name for p in PACKAGE.iterdir() if p.suffix == ".py"}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert files == {"__init__.py", "__main__.py"}
    assert folders == set(LAYERS)


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for path, parts in modules():
        own = layer(parts)
        if own is None:
            continue
        for line, target in imported(path, parts):
            other = layer(target)
            if other is not None and other < own:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {'.'.join(target)}")
    assert upward == []


def public_functions():
    """(where, function) for every public function and method of a public class."""
    for path, _ in modules():
        tree = ast.parse(path.read_text())
        scopes = [(tree, "")]
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                scopes.append((node, node.name + "."))
        for scope, prefix in scopes:
            for node in scope.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    not node.name.startswith("_") or node.name == "__init__"
                ):
                    yield f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {prefix}{node.name}", node


@pytest.mark.parametrize("what", ["parameters", "return"])
def test_every_public_function_has_type_hints(what):
    missing = []
    for where, node in public_functions():
        args = node.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, [args.vararg, args.kwarg])]
        if what == "parameters":
            bare = [a.arg for a in params if a.annotation is None and a.arg not in ("self", "cls")]
            if bare:
                missing.append(f"{where}: {', '.join(bare)}")
        elif node.returns is None and node.name != "__init__":
            missing.append(where)
    assert missing == [], f"{len(missing)} without type hints on their {what}"
