"""TPU kernels verified on CPU: each kernel use run in Pallas interpret mode against the reference lowering.

A bucket's TPU program computes some attention ops with the Pallas flash kernel
(lower/kernels.py). Pallas TPU kernels run on CPU only in interpret mode, which executes the
kernel's own program (its grid, blocks, causal block skipping, segment-id masking) with XLA:CPU.
For each distinct kernel use this runs `attention.flash_call` — the function the TPU program
traces, with the arguments it was traced with — on random operands, and compares it with the
portable program's attention lowering (verified against eager PyTorch by the verify stage) on the
same operands with the same mask, written as that lowering takes it.

The operands keep the use's head dim, dtype, block sizes, causal flag, scale and mask form; the
batch is 2 (one sequence right-padded, one left-padded, so that causal rows with no valid key
occur), the heads at most two key/value heads with their query groups, and the sequences at most
two blocks: the same block structure (several blocks, causal blocks skipped, masked keys), at a
cost of seconds. A use that fails drops the kernels of its buckets (conversion keeps the portable
program there and says why).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from tpuexport.lower import attention

# Relative RMS error allowed between the kernel and the reference lowering, by operand dtype: both
# compute the dots with f32 accumulation; in bfloat16 the probabilities are rounded to bfloat16 in
# different places (per block in the kernel).
KERNEL_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
KERNEL_SEED = 7_000


@dataclasses.dataclass(frozen=True)
class KernelCheck:
    """One kernel use run in interpret mode against the reference lowering.

    Attributes:
      use: the KernelUse (at the bucket's shapes).
      shape: the shape it ran at {"batch", "heads", "kv_heads", "q", "k", "head_dim"}.
      error: relative RMS error of the kernel vs the reference.
      tolerance: the allowed error.
    """

    use: attention.KernelUse
    shape: dict
    error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(self.error <= self.tolerance)

    def to_json(self) -> dict:
        return {"kernel": self.use.kernel, "block_sizes": self.use.block_sizes, "causal": self.use.causal, "scale": self.use.scale,
                "key_mask": self.use.key_mask, "query_mask": self.use.query_mask, "dtype": self.use.dtype,
                "ran_at": self.shape, "relative_rms_error": self.error, "tolerance": self.tolerance, "passed": self.passed,
                "how": "Pallas interpret mode on CPU vs the portable attention lowering"}


def verify_kernel_use(use: attention.KernelUse, kernel: Callable | None = None) -> KernelCheck:
    """Runs one kernel use in interpret mode against the reference lowering.

    Args:
      use: a KernelUse with a kernel (block sizes).
      kernel: the kernel call to check; None for `attention.flash_call` as the lowering calls it
        now (looked up at the call, so that it is the function the TPU program was traced with).
    Returns:
      The KernelCheck.
    """
    from jax.experimental.pallas import tpu as pltpu  # Pallas loads only where kernels are used

    kernel = kernel or attention.flash_call
    block = use.block_sizes["block_k"]
    q_len, k_len = min(use.q_len, 2 * use.block_sizes["block_q"]), min(use.k_len, 2 * block)
    kv_heads = min(use.kv_heads, 2)
    heads = kv_heads * min(use.heads // use.kv_heads, 2)
    dtype = jnp.dtype(use.dtype)
    generator = np.random.default_rng(KERNEL_SEED)
    query, key, value = (jnp.asarray(generator.standard_normal(shape, np.float32)).astype(dtype)
                         for shape in ((2, heads, q_len, use.head_dim), (2, kv_heads, k_len, use.head_dim),
                                       (2, kv_heads, k_len, use.head_dim)))
    key_valid = query_valid = None
    if use.key_mask:  # sequence 0 right-padded by a quarter; sequence 1 left-padded by half a block and more
        positions = np.arange(k_len)
        keys = np.stack([positions < k_len - k_len // 4, positions >= block // 2 + k_len // 4])
        key_valid = jnp.asarray(keys[:, None, None, :])
    if use.query_mask:
        rows = np.ones((2, q_len), bool)
        rows[1, : q_len // 3] = False
        query_valid = jnp.asarray(rows[:, None, :, None])
    with pltpu.force_tpu_interpret_mode():
        actual = jax.jit(lambda *operands: kernel(*operands, use.causal, use.scale, use.block_sizes))(
            query, key, value, key_valid, query_valid)
    mask = attention.parts_mask(key_valid, query_valid, use.causal, q_len, k_len)
    expected = attention.scaled_dot_product_attention(query, key, value, mask, 0.0, use.causal and mask is None, use.scale)
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    error = float(np.sqrt(np.mean((actual - expected) ** 2)) / max(np.sqrt(np.mean(expected ** 2)), 1e-30))
    if not np.isfinite(error):
        error = float("inf")
    shape = {"batch": 2, "heads": heads, "kv_heads": kv_heads, "q": q_len, "k": k_len, "head_dim": use.head_dim}
    return KernelCheck(use, shape, error, KERNEL_TOLERANCE[use.dtype])


def verify_kernels(uses) -> dict[str, KernelCheck]:
    """Each distinct kernel use among `uses` (KernelUses, with or without a kernel) checked once.

    Returns:
      {use as checked (shapes that do not change the check dropped): its KernelCheck}; look up a
      use with `check_key`.
    """
    checks = {}
    for use in uses:
        if use.kernel and check_key(use) not in checks:
            checks[check_key(use)] = verify_kernel_use(use)
    return checks


def check_key(use: attention.KernelUse) -> str:
    """What the reduced run of a use depends on (its batch, extra heads and sequence beyond two blocks do not count)."""
    reduced = dataclasses.replace(use, batch=2, heads=min(use.kv_heads, 2) * min(use.heads // use.kv_heads, 2),
                                  kv_heads=min(use.kv_heads, 2), q_len=min(use.q_len, 2 * use.block_sizes["block_q"]),
                                  k_len=min(use.k_len, 2 * use.block_sizes["block_k"]))
    return json.dumps(reduced.to_json(), sort_keys=True)
