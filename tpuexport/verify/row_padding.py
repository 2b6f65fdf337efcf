"""How a runtime pads a bucket, and whether it may: what the padding check (padding.py) verifies and
the runtime does, in a module the runtime imports without torch."""

from __future__ import annotations

import numpy as np

# The value padded rows hold, in every input (the runtime pads with the same).
PAD_VALUE = 0


def padding_policy(signature, passed: bool | None) -> tuple[str | None, str]:
    """(the dim a runtime may pad to the next bucket, or None; why not, or "") for a program whose
    padded-bucket run `passed` (None: no padded run, no bucket is ever padded).

    Args:
      signature: the program's signature (a ProgramSignature).
      passed: PaddingCheck.passed, or None.
    """
    dim = signature.batch_dim()
    if dim is None:
        return None, "the program has no batch dim shared by every input and output"
    if passed is None:
        return None, "no padded bucket was verified (the artifact predates padding checks, or no bucket is ever padded)"
    if not passed:
        return None, "padding the batch dim failed verification (manifest padding)"
    return dim, ""


def pad_rows(array: np.ndarray, size: int) -> np.ndarray:
    """`array` with rows of PAD_VALUE appended along axis 0 up to `size` rows."""
    if array.shape[0] == size:
        return array
    padding = np.full((size - array.shape[0], *array.shape[1:]), PAD_VALUE, dtype=array.dtype)
    return np.concatenate([array, padding])
