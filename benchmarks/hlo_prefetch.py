"""What XLA:TPU's bytes accessed count for weights it prefetches into on-chip memory (VMEM), read
from a compiled program's HLO text; shared by native_jax.py and the text-generation studies.

XLA's bytes accessed count every instruction's operands and results in any memory space. A weight
copied into VMEM ahead of use (`copy-start` of a whole array, `slice-start` of a piece; memory space
S(1)) is read from HBM once but counted 5 / 4 times: chains of Llama-1B MLPs at batch 8 measure
bytes accessed = weights + 4 x (copy-start bytes) + 3 x (slice-start bytes) exactly
(studies/decode_bytes.py prefetch). The extra counts are VMEM traffic and bookkeeping, not HBM
traffic; `without_prefetch_bookkeeping` subtracts them.
"""

from __future__ import annotations

import re

COPY_START_EXTRA, SLICE_START_EXTRA = 4, 3  # measured by studies/decode_bytes.py prefetch
_ELEMENT_BYTES = {"bf16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1}
_SHAPE = re.compile(r"\b(bf16|f32|s32|u32|pred|s8)\[([0-9,]*)\]")


def prefetched_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes the ENTRY computation copies into VMEM ahead of use: {"copy-start": ..., "slice-start": ...}."""
    found = {"copy-start": 0, "slice-start": 0}
    for line in hlo_text[hlo_text.index("\nENTRY"):].splitlines():
        match = re.search(r"= (.*?) (copy-start|slice-start)\(", line)
        if not match:
            continue
        shapes = _SHAPE.findall(match.group(1))  # copy-start: (dest, src, context); slice-start: ((src), dest, context)
        dtype, dims = shapes[0] if match.group(2) == "copy-start" else shapes[1]
        count = _ELEMENT_BYTES[dtype]
        for size in filter(None, dims.split(",")):
            count *= int(size)
        found[match.group(2)] += count
    return found


def without_prefetch_bookkeeping(bytes_accessed: float, prefetched: dict[str, int]) -> float:
    """XLA's bytes accessed less the extra counts of its VMEM prefetches (each prefetched byte read once)."""
    return bytes_accessed - COPY_START_EXTRA * prefetched["copy-start"] - SLICE_START_EXTRA * prefetched["slice-start"]
