"""Why torch.export refused a declared dim, in one line: the range the model needs and where.

torch.export raises "Constraints violated (seq)!" when the model's code cannot run at every size a
dim was declared with: a branch on the size narrows its range (`if x.shape[1] > 4`), a reshape into
pairs needs a multiple of 2, a ceil-mode pool over a free length fixes it to the example's size.
Its message ends with the declaration that would export ("Suggested fixes:") but not the line of
the model that needs it, and it is several lines long. A guard that rules out one size ("seq - 1 !=
1", MobileBERT's trigram embedding at seq 2) comes with no suggested fix at all: the line names the
size and the declared range without it. The line comes from tracing once more with
`torch.export.draft_export`, which records where each guard was added; that happens only on this
failure path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

import sympy
import torch
from torch._logging import structured
from torch.utils import _pytree as pytree

from tpuexport.source_lines import is_user_code

# "seq = 6", "seq = Dim('seq', min=5, max=16)", "seq = 2*_seq": one declaration per line.
_FIX = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.+?)\s*$")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPECIALIZED = re.compile(r"You marked (\S+) as dynamic but your code specialized it to be a constant \((\d+)\)")
_EXCLUDED = re.compile(r"Not all values of (\w+) = (\S+) in the specified range .*? satisfy the generated guard (.+) != (-?\d+)\.?\s*$",
                       re.MULTILINE)
_DIM = re.compile(r"Dim\(\s*['\"]([A-Za-z_][A-Za-z0-9_]*)['\"]\s*(?:,\s*min\s*=\s*(\d+))?\s*(?:,\s*max\s*=\s*(\d+))?\s*\)")


def suggested_fixes(message: str) -> dict[str, str]:
    """torch.export's suggested declarations: {dim name: what it must be, in tpuexport's words}.

    Args:
      message: the text of torch.export's constraint violation.
    Returns:
      {"seq": "in 5..16"} (or "at least 5") for a narrowed range, {"seq": "= 6"} for a dim fixed to a size,
      {"seq": "= 2*_seq with _seq in 1..8"} for a size the code needs a multiple of; empty when
      the message suggests nothing.
    """
    _, _, suggestions = message.partition("Suggested fixes:")
    declared: dict[str, str] = {}
    # A derived dim fixed to a size gets no suggestion, only "You marked 2*k as dynamic but your code
    # specialized it to be a constant (8)".
    for expression, size in _SPECIALIZED.findall(message):
        declared[expression] = f"= {size}"
    for line in suggestions.splitlines():
        match = _FIX.match(line)
        if not match:
            if declared:  # the block ends at the first line that is not a declaration
                break
            continue
        name, value = match.groups()
        dim = _DIM.fullmatch(value)
        if dim:
            low, high = dim.group(2) or "1", dim.group(3)
            declared[name] = f"in {low}..{high}" if high else f"at least {low}"
        else:
            declared[name] = f"= {value}"
    # A derived dim ("seq = 2*_seq") names a helper dim declared on its own line: say them together.
    for name, value in list(declared.items()):
        for helper in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", value.removeprefix("= ")):
            if helper != name and helper in declared and value.startswith("= "):
                declared[name] = f"{value} with {helper} {declared.pop(helper)}"
    return declared


def excluded_sizes(message: str) -> dict[str, int]:
    """Sizes a guard of the form "EXPR != k" rules out of a declared range, which torch.export
    reports without a suggested fix ("Not all values of seq = L['x'].size()[1] in the specified
    range seq <= 64 satisfy the generated guard ((-1) + L['x'].size()[1]) != 1"): {"seq": 2}."""
    excluded: dict[str, int] = {}
    for name, source, expression, value in _EXCLUDED.findall(message):
        symbol = sympy.Symbol(name, integer=True)
        try:
            solutions = sympy.solve(sympy.sympify(expression.replace(source, name), locals={name: symbol}) - int(value), symbol)
        # sympify evaluates the guard's Python text, so whatever it holds can raise (PEGASUS-X's guard calls
        # `.sym_max(...)` on a size: AttributeError): an expression sympy cannot read or solve gives no explanation.
        except Exception:
            continue
        if len(solutions) == 1 and solutions[0].is_integer:
            excluded[name] = int(solutions[0])
    return excluded


def _declared_ranges(dynamic_shapes) -> dict[str, tuple[int, int]]:
    """{dim name: (min, max)} of the torch.export.Dims in dynamic_shapes."""
    leaves = pytree.tree_leaves(dynamic_shapes, is_leaf=lambda leaf: hasattr(leaf, "min") and hasattr(leaf, "max"))
    return {leaf.__name__: (int(leaf.min), int(leaf.max)) for leaf in leaves if hasattr(leaf, "min") and hasattr(leaf, "max")}


def _range_without(declared: tuple[int, int] | None, size: int) -> str:
    """A `suggested_fixes`-style need: the declared range less `size` at either end."""
    if declared is None:
        return f"at least {size + 1}"
    low, high = declared
    return f"in {size + 1}..{high}" if size <= low else f"in {low}..{size - 1}"


def guard_sources(model: torch.nn.Module, args, dynamic_shapes) -> list[str]:
    """The user's source lines where torch.export added guards that narrow the declared ranges.

    Args:
      model, args, dynamic_shapes: what torch.export.export was given.
    Returns:
      ["file.py:12 (code)", ...], each line once, in trace order; empty when tracing again does not
      say (the explanation must not fail).
    """
    sources: list[str] = []
    try:
        with _quiet_draft_export(), torch.no_grad():
            report = torch.export.draft_export(model, args, dynamic_shapes=dynamic_shapes)._report
        # The report names only the files first seen in this trace; the process's table has them all.
        filenames = {index: name for name, index in structured.INTERN_TABLE.items()} | report.str_to_filename
        for failure in report.failures:
            files = [filenames.get(frame.get("filename"), "<unknown>") for frame in failure.data.get("user_stack") or ()]
            # The stack of a guard torch adds outside the model's code ends in tpuexport's call: not the user's line.
            frames = [(path, frame) for path, frame in zip(files, failure.data.get("user_stack") or ())
                      if is_user_code(path) and not os.path.abspath(path).startswith(_PACKAGE_DIR)]
            if frames:
                path, frame = frames[-1]
                source = f"{path}:{frame['line']} ({frame['loc'].strip()})"
                if source not in sources:
                    sources.append(source)
    except Exception:  # draft_export is another trace of the user's model: anything may go wrong in it
        return sources
    return sources


def explain(model: torch.nn.Module, args, dynamic_shapes, message: str) -> str | None:
    """One line saying what torch.export's constraint violation needs, or None if it is not one.

    Args:
      model, args, dynamic_shapes: what torch.export.export was given.
      message: the text torch.export raised.
    Returns:
      e.g. "torch.export: the model's code needs seq in 5..16, at model.py:8 (if x.shape[1] > 4:);
      declare seq that range (--dim seq=5:16, or torch.export.Dim('seq', min=5, max=16)), or change
      that code to work for every declared size".
    """
    if "Constraints violated" not in message:
        return None
    needs = suggested_fixes(message)
    excluded = excluded_sizes(message)
    if not needs and not excluded:
        return None
    where = _where(guard_sources(model, args, dynamic_shapes))
    if not needs:  # no range can say "every size but k": the line names the size and a range without it
        declared = _declared_ranges(dynamic_shapes)
        what = " and ".join(f"{name} = {size}" for name, size in excluded.items())
        declarations = [_declaration(name, _range_without(declared.get(name), size)) for name, size in excluded.items()]
        return (f"torch.export: the model's code cannot take {what}{where}; declare {' and '.join(declarations)}, "
                "or change that code to work for every declared size")
    what = ", ".join(f"fixes {name} at {need[2:]}" if re.fullmatch(r"= \d+", need) else f"needs {name} {need}" for name, need in needs.items())
    declarations = [_declaration(name, need) for name, need in needs.items()]
    return (f"torch.export: the model's code {what}{where}; declare {' and '.join(declarations)}, "
            "or change that code to work for every declared size")


def _where(sources: list[str]) -> str:
    """The line's ", at file.py:12 (code) and 16 more lines": the first source line torch.export guarded
    at, and how many more. Blocked attention reshapes a padded length at every step (PEGASUS-X: 17
    lines, 4000 characters in one message); the first is where the size is first needed."""
    if not sources:
        return ""
    more = f" and {len(sources) - 1} more line{'s' if len(sources) > 2 else ''}" if len(sources) > 1 else ""
    return f", at {sources[0]}{more}"


def _declaration(name: str, need: str) -> str:
    """How a user declares what `suggested_fixes` says a dim needs (both ways dims are given)."""
    ranged = re.fullmatch(r"in (\d+)\.\.(\d+)", need)
    if ranged:
        low, high = ranged.groups()
        return f"{name} that range (--dim {name}={low}:{high}, or torch.export.Dim({name!r}, min={low}, max={high}))"
    if need.startswith("at least "):
        low = need.removeprefix("at least ")
        return f"{name} from {low} (--dim {name}={low}:MAX, or torch.export.Dim({name!r}, min={low}))"
    fixed = re.fullmatch(r"= (\d+)", need)
    if fixed and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):  # a derived dim: no --dim names it
        return f"{name} static (the int {fixed.group(1)} in dynamic_shapes)"
    if fixed:
        return f"{name} static (--dim {name}={fixed.group(1)}:{fixed.group(1)}, or the int {fixed.group(1)} in dynamic_shapes)"
    return f"{name} as that derived torch.export.Dim in dynamic_shapes"


@contextlib.contextmanager
def _quiet_draft_export():
    """draft_export logs its report as warnings; the explanation is the one line the user sees."""
    logger = logging.getLogger("torch.export._draft_export")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
