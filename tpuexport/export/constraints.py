"""Why torch.export refused a declared dim, in one line: the range the model needs and where.

torch.export raises "Constraints violated (seq)!" when the model's code cannot run at every size a
dim was declared with: a branch on the size narrows its range (`if x.shape[1] > 4`), a reshape into
pairs needs a multiple of 2, a ceil-mode pool over a free length fixes it to the example's size.
Its message ends with the declaration that would export ("Suggested fixes:") but not the line of
the model that needs it, and it is several lines long. A guard that rules out one size ("seq - 1 !=
1", MobileBERT's trigram embedding at seq 2) comes with no suggested fix at all: the line names the
size and the declared range without it. The line names where the model's code guarded the sizes,
from what `guard_sites.recorded` kept during that export.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import sys

import torch
from torch.utils import _pytree as pytree

# "seq = 6", "seq = Dim('seq', min=5, max=16)", "seq = 2*_seq": one declaration per line.
_FIX = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.+?)\s*$")
_SPECIALIZED = re.compile(r"You marked (\S+) as dynamic but your code specialized it to be a constant \((\d+)\)")
# One line per guard: "Not all values of seq = L['x'].size()[1] in the specified range seq <= 64 satisfy the generated guard G."
_GUARD = re.compile(r"Not all values of (\w+) = (\S+) in the specified range .*? satisfy the generated guard (.+?)\.?\s*$", re.MULTILINE)
# How far past its minimum an unbounded dim's guards are checked: the sizes guards single out (a window, a
# block, one length) are a few tokens or patches, far below this.
_UNBOUNDED_SCAN = 4096
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


def guarded_sizes(message: str, declared: dict[str, tuple[int, int | None]]) -> dict[str, tuple[list[int], list[str]]]:
    """The sizes of each declared range at which the guards torch.export reports without a suggested fix hold.

    Such a guard rules out one size ("((-1) + L['x'].size()[1]) != 1", MobileBERT's trigram embedding at
    seq 2), or bounds a size through torch.sym_max ("torch.sym_max(0, (-5) + L['input_ids'].size()[1]) > 0",
    VITS pads its relative positions only past its window: seq >= 6), which torch's solver turns into no
    range; or it holds at every size and torch cannot prove it ("((-1) + seq + 2*seq*seq) % (1 + seq) == 0",
    VITS's reshape of (2 seq - 1)(seq + 1) elements into seq + 1 rows). Evaluating each guard at each size
    tells these apart.

    Args:
      message: the text of torch.export's constraint violation.
      declared: {dim name: (min, max or None when unbounded)}; a dim the message names but `declared`
        lacks is not read.
    Returns:
      {dim: (the sizes checked at which every guard on it holds, the guards that hold at every size checked,
      with the dim's name for its source)}, for each dim whose guards name it alone and evaluate as
      Python at sizes (an unbounded range is checked up to _UNBOUNDED_SCAN past its minimum).
    """
    guards: dict[str, list[str]] = {}
    unreadable: set[str] = set()
    for name, source, guard in _GUARD.findall(message):
        if name not in declared or "L[" in guard.replace(source, ""):  # a guard relating two dims: no range of one says it
            unreadable.add(name)
            continue
        guards.setdefault(name, []).append(" ".join(guard.replace(source, name).split()))
    sizes: dict[str, tuple[list[int], list[str]]] = {}
    for name, texts in guards.items():
        low, high = declared[name]
        checked = range(low, (high if high is not None else low + _UNBOUNDED_SCAN) + 1)
        try:
            holds = [[bool(_evaluate(code, name, size)) for size in checked] for code in map(_compiled, texts)]
        # The guard is torch's Python text; what torch prints but plain ints cannot run (PEGASUS-X's
        # `(seq).sym_max(8)`: AttributeError) gives no range.
        except Exception:
            continue
        if name not in unreadable:
            sizes[name] = ([size for size, *each in zip(checked, *holds) if all(each)], [text for text, row in zip(texts, holds) if all(row)])
    return sizes


def _compiled(guard: str):
    """A guard's Python text compiled once: a range as long as a context (131072 sizes) is checked size by size."""
    return compile(guard, "<guard>", "eval")


def _evaluate(guard, name: str, size: int):
    """A compiled guard at one size of its dim: torch's printer writes sizes' max and min as
    torch.sym_max / torch.sym_min and nothing else from outside the expression."""
    return eval(guard, {"__builtins__": {}, "torch": torch, "math": math}, {name: size})  # noqa: S307 (torch's own guard text)


def _declared_ranges(dynamic_shapes) -> dict[str, tuple[int, int | None]]:
    """{dim name: (min, max, or None for a Dim declared without one)} of the torch.export.Dims in dynamic_shapes."""
    leaves = pytree.tree_leaves(dynamic_shapes, is_leaf=lambda leaf: hasattr(leaf, "min") and hasattr(leaf, "max"))
    return {leaf.__name__: (int(leaf.min), int(leaf.max) if leaf.max < sys.maxsize else None)
            for leaf in leaves if hasattr(leaf, "min") and hasattr(leaf, "max")}


def _example_sizes(model: torch.nn.Module, args, message: str) -> dict[str, int]:
    """{dim name: its size in the example args}, from the source each guard line names (L['input_ids'].size()[1]:
    the forward's arguments by name)."""
    try:
        arguments = inspect.signature(model.forward).bind(*args).arguments
    except (TypeError, ValueError):
        return {}
    sizes: dict[str, int] = {}
    for name, source, _ in _GUARD.findall(message):
        try:
            sizes[name] = int(eval(source, {"__builtins__": {}}, {"L": arguments}))  # noqa: S307 (torch's own source text)
        except Exception:  # a source naming what the forward's signature does not: no size
            continue
    return sizes


def _range_without(declared: tuple[int, int | None], size: int) -> str:
    """A `suggested_fixes`-style need: the declared range less `size` at either end."""
    low, high = declared
    if size > low and high is not None:
        return f"in {low}..{size - 1}"
    return f"in {size + 1}..{high}" if high is not None else f"at least {size + 1}"


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What a constraint violation needs.

    Attributes:
      line: the one line, e.g. "torch.export: the model's code needs seq in 5..16, at model.py:8 (if
        x.shape[1] > 4:); declare seq that range (--dim seq=5:16, or torch.export.Dim('seq', min=5,
        max=16)), or change that code to work for every declared size".
      needs: the middle of the line: what the code needs and where ("needs seq in 5..16, at model.py:8 (...)").
      ranges: {dim: (min, max)} when every dim it names is narrowed within the declared range (min ==
        max where the code fixes it to one size; not a derived dim), else {}: declaring those ranges
        instead exports (a source decides whether it takes them: LoadedSource.at_ranges).
    """

    line: str
    needs: str
    ranges: dict[str, tuple[int, int]]


def explain(model: torch.nn.Module, args, dynamic_shapes, message: str, guarded_at: list[str]) -> Explanation | None:
    """What torch.export's constraint violation needs (see Explanation), or None if it is not one.

    Args:
      model, args, dynamic_shapes: what torch.export.export was given.
      message: the text torch.export raised.
      guarded_at: the user's source lines where that export guarded the input sizes, in trace order
        (`guard_sites.recorded`); the line names the first.
    """
    unprinted = _unprinted_bound(message, _declared_ranges(dynamic_shapes))
    if unprinted is None and "Constraints violated" not in message:
        return None
    needs = unprinted or suggested_fixes(message)
    if needs:
        what = ", ".join(f"fixes {name} at {need[2:]}" if re.fullmatch(r"= \d+", need) else f"needs {name} {need}"
                         for name, need in needs.items())
    else:
        what, needs = _guarded_needs(model, args, dynamic_shapes, message)
        if not needs:
            return None
    declarations = [declaration(name, need) for name, need in needs.items()]
    where = _where(guarded_at)
    line = (f"torch.export: the model's code {what}{where}; declare {' and '.join(declarations)}, "
            "or change that code to work for every declared size")
    return Explanation(line, f"{what}{where}", _ranges(needs, _declared_ranges(dynamic_shapes)))


# torch.export's report of a bound the model's code puts on a dim fails when the bound is a fraction: its prettify_results
# asserts ("Expected op to be '==', got <= for batch <= 25/9": Mimi's code takes batch up to 2) where it would have raised the
# constraint violation.
_UNPRINTED_BOUND = re.compile(r"Expected op to be '==', got (?:<=|<|>=|>) for ([A-Za-z_]\w*) (<=|<|>=|>) (\d+)/(\d+)")


def _unprinted_bound(message: str, declared: dict[str, tuple[int, int | None]]) -> dict[str, str] | None:
    """{dim: need, as suggested_fixes says it} of a bound torch.export failed to report (_UNPRINTED_BOUND),
    or None when the message is not one."""
    match = _UNPRINTED_BOUND.search(message)
    if match is None or match.group(1) not in declared:
        return None
    name, op, numerator, denominator = match.group(1), match.group(2), int(match.group(3)), int(match.group(4))
    low, high = declared[name]
    if op in ("<=", "<"):
        high = numerator // denominator if op == "<=" else -(-numerator // denominator) - 1
    else:
        low = -(-numerator // denominator) if op == ">=" else numerator // denominator + 1
    return {name: f"in {low}..{high}" if high is not None else f"at least {low}"}


def _ranges(needs: dict[str, str], declared: dict[str, tuple[int, int | None]]) -> dict[str, tuple[int, int]]:
    """Explanation.ranges of `suggested_fixes`-style needs."""
    ranges = {}
    for name, need in needs.items():
        bounded = re.fullmatch(r"in (\d+)\.\.(\d+)", need)
        at_least = re.fullmatch(r"at least (\d+)", need)
        fixed = re.fullmatch(r"= (\d+)", need)
        if bounded:
            low, high = map(int, bounded.groups())
        elif fixed:
            low = high = int(fixed.group(1))
        elif at_least and declared.get(name, (0, None))[1] is not None:
            low, high = int(at_least.group(1)), declared[name][1]
        else:
            return {}
        if name not in declared:
            return {}
        declared_low, declared_high = declared[name]  # within the declared range: narrowed, never widened
        low, high = max(low, declared_low), min(high, declared_high) if declared_high is not None else high
        if high < low or (high == low and not fixed):
            return {}
        ranges[name] = (low, high)
    return ranges


def _guarded_needs(model: torch.nn.Module, args, dynamic_shapes, message: str) -> tuple[str, dict[str, str]]:
    """What the guards of a message without suggested fixes need ("cannot take seq = 2", "needs seq in
    6..512") and, per dim, the need that exports (as `suggested_fixes` says them), from `guarded_sizes`;
    ("", {}) when they say nothing."""
    declared = _declared_ranges(dynamic_shapes)
    examples = _example_sizes(model, args, message)
    phrases, needs = [], {}
    for name, (allowed, unproven) in guarded_sizes(message, declared).items():
        low, high = declared[name]
        checked_high = high if high is not None else low + _UNBOUNDED_SCAN
        if not allowed or allowed != list(range(allowed[0], allowed[-1] + 1)) and len(allowed) != checked_high - low:
            continue  # the sizes that pass are not one range nor all but one: no declaration says them
        if len(allowed) == checked_high - low:  # a guard like `seq - 1 != 1` rules out one size
            size = next(size for size in range(low, checked_high + 1) if size not in set(allowed))
            phrase, need = f"cannot take {name} = {size}", _range_without(declared[name], size)
        elif len(allowed) < checked_high - low:
            top = allowed[-1] if allowed[-1] < checked_high or high is not None else None
            need = f"in {allowed[0]}..{top}" if top is not None else f"at least {allowed[0]}"
            phrase = f"needs {name} {need}"
        elif name in examples:  # every guard holds at every size, and no range lets torch.export prove it: one size exports
            phrase = f"has a guard {unproven[0]} that holds at every declared {name} but torch.export cannot prove for a range"
            need = f"= {examples[name]}"
        else:
            continue
        phrases.append(phrase)
        needs[name] = need
    return " and ".join(phrases), needs


def _where(sources: list[str]) -> str:
    """The line's ", at file.py:12 (code) and 16 more lines": the first source line torch.export guarded
    at, and how many more. Blocked attention reshapes a padded length at every step (PEGASUS-X: 17
    lines, 4000 characters in one message); the first is where the size is first needed."""
    if not sources:
        return ""
    more = f" and {len(sources) - 1} more line{'s' if len(sources) > 2 else ''}" if len(sources) > 1 else ""
    return f", at {sources[0]}{more}"


def declaration(name: str, need: str) -> str:
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
    largest = _largest_derived(need)
    if largest is not None:  # --dim declares ranges, not multiples: one size of them converts
        return (f"{name} as that derived torch.export.Dim in dynamic_shapes, or one size it takes "
                f"(--dim {name}={largest}:{largest}, the largest)")
    return f"{name} as that derived torch.export.Dim in dynamic_shapes"


def _largest_derived(need: str) -> int | None:
    """The largest size a derived need ("= 128*_seq - 8 with _seq in 3..8") takes, or None when it
    is not one with a bounded helper."""
    derived = re.fullmatch(r"= (\d+)\*([A-Za-z_]\w*)(?: ([+-]) (\d+))? with \2 in (\d+)\.\.(\d+)", need)
    if derived is None:
        return None
    factor, _, sign, offset, _, high = derived.groups()
    return int(factor) * int(high) + (int(offset or 0) if sign != "-" else -int(offset))
