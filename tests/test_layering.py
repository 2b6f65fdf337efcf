"""The stage packages' import layering, read from the source (ast): every stage imports only the
stages below it and the shared modules; nothing below imports what composes the stages."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tpuexport"
# Bottom to top: each stage may import only those before it.
STAGES = ("export", "quantize", "lower", "compile", "verify", "artifact")
# What sits above every stage: nothing in a stage or a shared module may import these.
ABOVE_STAGES = ("tasks", "runtime", "serve", "deployment", "pipeline", "gate", "api", "cli", "__init__")


def imported_modules(path: pathlib.Path, typing_only: bool = True) -> set[str]:
    """The tpuexport modules a module imports, dotted (function-level imports included):
    "tpuexport.lower.generation", or a package ("tpuexport.lower") for `from tpuexport import lower`;
    without `typing_only`, imports under `if TYPE_CHECKING:` (never run) are left out."""
    modules = set()
    module_parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    tree = ast.parse(path.read_text(), str(path))
    skipped = set() if typing_only else {id(child) for node in ast.walk(tree)
                                          if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
                                          for statement in node.body for child in ast.walk(statement)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module_parts[: len(module_parts) - node.level]
                module = ".".join(base + ((node.module,) if node.module else ()))
            else:
                module = node.module
            # from tpuexport.export import huggingface: the module itself where the name is one.
            names = [f"{module}.{alias.name}" if _is_module(f"{module}.{alias.name}") else module for alias in node.names]
        else:
            continue
        modules.update(name for name in names if name and name.split(".")[0] == "tpuexport")
    return modules


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_parts(path: pathlib.Path) -> set[str]:
    """The tpuexport parts a module imports (function-level imports included): the first name under
    `tpuexport` ("lower", "errors", ...), or "__init__" for the package's own API."""
    return {name.split(".")[1] if "." in name else "__init__" for name in imported_modules(path)}


def part_of(path: pathlib.Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def layering() -> dict[str, set[str]]:
    """{package or root module: the other tpuexport parts it imports}."""
    table: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        part = part_of(path)
        table.setdefault(part, set()).update(imported_parts(path) - {part})
    return table


def test_imports_are_parsed_from_every_form():
    """The parser sees the forms the package uses, so the layering test below can fail."""
    source = PACKAGE / "pipeline.py"
    assert {"export", "lower", "compile", "verify", "artifact", "errors"} <= imported_parts(source)
    assert {"lower"} <= imported_parts(PACKAGE / "verify" / "verification.py")
    assert "quantize" in imported_parts(PACKAGE / "lower" / "registry.py")  # a function-level import


@pytest.mark.parametrize("stage", STAGES)
def test_stage_imports_only_stages_below_it(stage):
    table = layering()
    below = set(STAGES[: STAGES.index(stage)])
    shared = {part for part in table if part not in STAGES and part not in ABOVE_STAGES}
    print("\nimport layering (bottom to top):")
    for name in STAGES:
        print(f"  {name:9s} -> {', '.join(sorted(table.get(name, ()))) or '-'}")
    upward = sorted(table[stage] - below - shared)
    assert not upward, f"{stage} imports {upward}, which are not below it ({' < '.join(STAGES)})"


def test_shared_modules_import_no_stage():
    """errors, arrays, signature, inputs, _runtime sit below every stage."""
    table = layering()
    shared = {part for part in table if part not in STAGES and part not in ABOVE_STAGES}
    assert {"errors", "arrays", "signature", "inputs"} <= shared
    for name in shared:
        assert not table[name] - shared, f"{name} imports {sorted(table[name] - shared)}"


def module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def cycles_within_packages() -> list[list[str]]:
    """Import cycles between the modules of one package (its __init__ aside, which gathers them; type
    annotations' imports aside, which never run)."""
    found = []
    for package in sorted({path.parent for path in PACKAGE.rglob("*.py")}):
        modules = {module_name(path): path for path in package.glob("*.py") if path.name != "__init__.py"}
        graph = {name: {other for other in imported_modules(path, typing_only=False) if other in modules and other != name}
                 for name, path in modules.items()}
        state: dict[str, str] = {}

        def visit(name: str, stack: list[str]) -> None:
            state[name] = "open"
            for other in sorted(graph[name]):
                if state.get(other) == "open":
                    found.append(stack[stack.index(other):] + [name, other] if other in stack else [name, other])
                elif other not in state:
                    visit(other, stack + [name])
            state[name] = "done"

        for name in sorted(graph):
            if name not in state:
                visit(name, [])
    return found


def test_no_import_cycle_between_modules_of_a_package():
    """A cycle (export/sources.py and export/huggingface.py imported each other) means two modules
    are one; the records they share belong in a module both import."""
    assert cycles_within_packages() == []


def test_a_cycle_is_found(tmp_path, monkeypatch):
    """The cycle check sees one: two modules of a package that import each other."""
    package = tmp_path / "tpuexport" / "example"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "first.py").write_text("from tpuexport.example import second\n")
    (package / "second.py").write_text("def f():\n    from tpuexport.example.first import thing\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "tpuexport")
    assert cycles_within_packages() == [["tpuexport.example.first", "tpuexport.example.second", "tpuexport.example.first"]]


@pytest.mark.parametrize("package", [*STAGES, ""])
def test_no_lazily_imported_name_is_a_module_of_its_package(package):
    """A package's names come from its modules on first use (tpuexport/lazy.py); importing a module
    of the same name would set the package's attribute to that module, hiding the name for good."""
    namespace = importlib.import_module(f"tpuexport.{package}" if package else "tpuexport")
    directory = PACKAGE / package
    assert namespace.__all__
    shadowed = [name for name in namespace.__all__ if (directory / f"{name}.py").is_file() or (directory / name / "__init__.py").is_file()]
    assert not shadowed, f"tpuexport{'.' + package if package else ''} exports {shadowed}, also modules of it: rename the modules"
