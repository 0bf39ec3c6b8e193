"""The package's shape: every module imports, no import cycles among its modules, and every
user-facing error class is defined in, and imported from, rwkv_clip/errors.py."""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import rwkv_clip
from rwkv_clip.errors import RWKVCLIPError

PACKAGE_DIR = Path(rwkv_clip.__file__).parent


def module_files() -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = module_files()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}
# ``python -m`` entry points run their command when imported
IMPORTABLE = sorted(name for name in MODULES if not name.endswith(".__main__"))


def runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement (module level or inside functions) that runs; imports under
    ``if TYPE_CHECKING:`` are for the type checker only and are left out."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return [node for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped]


def imported_module(module: str, node: ast.ImportFrom) -> str:
    """The absolute name of the module ``node`` (maybe relative) imports from."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if module in PACKAGES else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def known_module(name: str) -> str | None:
    """``name`` or its closest enclosing module of the package; None outside it."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports. An edge into a package ``__init__`` is left
    out: a package re-exporting its modules' names is how the public API is spelled."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets: set[str] = set()
        for node in runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                source = imported_module(module, node)
                names = [f"{source}.{alias.name}" for alias in node.names] + [source]
            for name in names:
                target = known_module(name)
                if target and target != module and target not in PACKAGES:
                    targets.add(target)
        graph[module] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("module", IMPORTABLE)
def test_every_module_imports(module):
    importlib.import_module(module)


def test_no_import_cycles():
    graph = import_graph()
    assert "rwkv_clip.model" in graph and graph["rwkv_clip.model"], "the graph is empty"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles among rwkv_clip modules: " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles)


def test_the_model_does_not_import_the_benchmarks():
    """rwkv_clip.bench is the code behind the benchmark scripts: no module a user of the
    model imports reaches it."""
    graph = import_graph()
    users = sorted(module for module, targets in graph.items()
                   if not module.startswith("rwkv_clip.bench")
                   and any(t.startswith("rwkv_clip.bench") for t in targets))
    assert not users, f"modules outside rwkv_clip.bench that import it: {users}"
    assert "rwkv_clip.bench.versus" in graph


def error_classes() -> dict[str, type]:
    """Every class deriving from RWKVCLIPError defined anywhere in the package."""
    found = {}
    for module in IMPORTABLE:
        for obj in vars(importlib.import_module(module)).values():
            if inspect.isclass(obj) and issubclass(obj, RWKVCLIPError):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_error_class_is_defined_in_errors():
    outside = sorted(name for name, cls in error_classes().items()
                     if cls.__module__ != "rwkv_clip.errors")
    assert not outside, f"error classes defined outside rwkv_clip/errors.py: {outside}"


def test_every_error_class_is_imported_from_errors():
    names = {cls.__name__ for cls in error_classes().values()}
    assert {"RWKVCLIPError", "CheckpointError", "EvalError", "DataError"} <= names
    wrong = []
    for module, path in MODULES.items():
        for node in runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = imported_module(module, node)
            for alias in node.names:
                if alias.name in names and source != "rwkv_clip.errors":
                    wrong.append(f"{module} imports {alias.name} from {source}")
    assert not wrong, "errors imported other than from rwkv_clip.errors: " + "; ".join(wrong)


def test_mypy_checks_the_whole_package():
    """CI runs ``mypy`` with pyproject.toml's settings: every module, no exceptions."""
    import tomllib

    pyproject = PACKAGE_DIR.parent / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not a source checkout")
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["mypy"]
    assert config["files"] == ["rwkv_clip"]
    assert not [o for o in config.get("overrides", []) if o.get("ignore_errors")]
