"""Why torch.export failed on an op that takes no symbolic size, in one line: the model's line and the dims.

Some ops have no kernel for symbolic sizes where torch.export traces them: UnivNet draws its noise with
`torch.randn(shape, generator=generator)`, whose generator overload wants concrete ints. torch raises
"SymIntArrayRef expected to contain only concrete integers ... Found symbolic SymInt at index 0: s6 in
SymIntArrayRef [s6, s37, 64]", naming a C++ file and symbols, not the model's line nor the declared dims.
The traceback holds both: the innermost frame of the user's code, and in the frames that handled the op
torch's shape environment, whose sources name each symbol's dim and whose values its example size.
"""

from __future__ import annotations

import os
import re
import traceback

import torch

from tpuexport.export.constraints import declaration
from tpuexport.source_lines import is_user_code

_CONCRETE = re.compile(r"SymIntArrayRef expected to contain only concrete integers.*? in SymIntArrayRef \[([^\]]*)\]", re.DOTALL)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def explain(error: BaseException) -> str | None:
    """One line for an op torch.export could not trace at symbolic sizes, or None if `error` is not that.

    Returns:
      e.g. "torch.export: the model's code passes a size from batch and seq to aten.randn.generator, which takes
      only fixed sizes, at modeling_univnet.py:533 (noise_sequence = torch.randn(); declare batch static (--dim batch=2:2, ...) and
      seq static (--dim seq=16:16, ...), or change that code to work for every declared size".
    """
    match = _CONCRETE.search(str(error))
    if not match:
        return None
    dims = _dims(error, set(re.findall(r"\bs\d+\b", match.group(1))))
    operators = [value for frame, _ in traceback.walk_tb(error.__traceback__) for value in frame.f_locals.values()
                 if isinstance(value, torch._ops.OpOverload)]
    op = f"{operators[-1]}, which takes only fixed sizes" if operators else "an op that takes only fixed sizes"
    user_frames = [frame for frame in traceback.extract_tb(error.__traceback__)
                   if is_user_code(frame.filename) and not os.path.abspath(frame.filename).startswith(_PACKAGE_DIR)]
    where = f", at {user_frames[-1].filename}:{user_frames[-1].lineno} ({(user_frames[-1].line or '').strip()})" if user_frames else ""
    if not dims:
        return (f"torch.export: the model's code passes a size from a declared dim to {op}{where}; "
                "declare the dims it comes from static (--dim NAME=N:N), or change that code to work for every declared size")
    declarations = [declaration(name, f"= {size}") for name, size in dims.items()]
    return (f"torch.export: the model's code passes a size from {' and '.join(dims)} to {op}{where}; "
            f"declare {' and '.join(declarations)}, or change that code to work for every declared size")


def _dims(error: BaseException, symbols: set[str]) -> dict[str, int]:
    """{declared dim name: its example size} of the shape symbols named, from the shape environment of the
    first SymInt in the traceback's frames (innermost first); empty when none is found."""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    for frame in reversed(frames):
        values = list(frame.f_locals.values())
        sizes = [value for value in values + [item for value in values if isinstance(value, (tuple, list)) for item in value]
                 if isinstance(value, torch.SymInt)]
        if not sizes:
            continue
        dims = {}
        try:
            environment = sizes[0].node.shape_env
            for symbol, sources in environment.var_to_sources.items():
                if str(symbol) in symbols and sources:
                    name = environment.source_name_to_debug_name.get(sources[0].name, str(symbol))
                    dims[name] = int(environment.backed_var_to_val[symbol])
        except (AttributeError, KeyError, TypeError):  # torch's internals, read only to explain: another torch may differ
            return {}
        return dims
    return {}
