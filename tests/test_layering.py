"""The stage packages' import layering, read from the source (ast): every stage imports only the
stages below it and the shared modules; nothing below imports what composes the stages."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tpuexport"
# Bottom to top: each stage may import only those before it.
STAGES = ("export", "quantize", "lower", "compile", "verify", "artifact")
# What sits above every stage: nothing in a stage or a shared module may import these.
ABOVE_STAGES = ("runtime", "serve", "pipeline", "gate", "cli", "__init__")


def imported_parts(path: pathlib.Path) -> set[str]:
    """The tpuexport parts a module imports (function-level imports included): the first name under
    `tpuexport` ("lower", "errors", ...), or "__init__" for the package's own API."""
    parts = set()
    module_parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module_parts[: len(module_parts) - node.level]
                names = [".".join(base + ((node.module,) if node.module else ()))]
            else:
                names = [node.module]
            if names == ["tpuexport"]:  # from tpuexport import lower as lower_stage
                names = [f"tpuexport.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            pieces = name.split(".")
            if pieces[0] == "tpuexport":
                parts.add(pieces[1] if len(pieces) > 1 else "__init__")
    return parts


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
