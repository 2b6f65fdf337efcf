"""Top-k selections among tied values: the reference breaks exact ties as XLA does, and a failed
verification names the near-ties that remain.

`torch.topk` over values that tie at its k-th choice keeps some of the tied candidates and drops the
others, and torch and XLA keep different ones (torch's CPU kernel does not take the lowest indices;
XLA's TopK, which the artifact runs, does: `jax.lax.top_k` puts "the lower-index element first"):
every output computed from the selection then differs, by whole candidates. Exact ties are common
where the selected scores pass through a ReLU (DeepSeek Sparse Attention's indexer scores keys with
`relu(q . k)`: every key all of whose heads score below zero scores exactly 0), and random models
tie far more often than trained ones (RT-DETR's tiny random detector scores 344 of its 1029 anchors
at the same -0.693).

So the eager references run under `TiesToLowestIndex`: torch.topk keeps the lowest indices among
exactly tied values, as the artifact does. It changes nothing else: values differing in their
last bit are selected as before.

Near-ties remain: values a few units in the last place apart, which the lowering's arithmetic (or a
bf16 rounding step before the selection: a tiny bf16 mixture-of-experts' router logits lie within
bf16's rounding of each other) can reorder. On a failed verification the reference runs once more,
on example inputs, watching every torch.topk over floats: a call whose k-th and (k+1)-th largest
values lie within TIE_ULPS units in the last place of the dtype the model computes in (its weights'
lowest-precision float dtype: a bf16 model's router probabilities are f32 computed from bf16 logits)
is reported with the model's source line. The failure stays a failure; its line says that outputs
after that selection need not match, so that a user checks the trained weights or real inputs before
suspecting the lowering.
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
import os
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

# Values this many units in the last place apart count as tied: a rounding step or a few of the
# arithmetic before the selection (a bf16 hidden state's) reorder them.
TIE_ULPS = 4
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclasses.dataclass(frozen=True)
class SelectionTie:
    """A top-k selection whose boundary falls among tied values.

    Attributes:
      where: the model's source line that called torch.topk ("file.py:12 (code)"), or "" if unknown.
      k: the selection's size; candidates: the values it chose from, per row.
      tied_rows: rows whose k-th and (k+1)-th values tie; rows: rows selected in.
      tied: in the first tied row, the candidates within the tie of its k-th value.
      value: that row's k-th value; dtype: the dtype whose units in the last place measured the tie.
    """

    where: str
    k: int
    candidates: int
    tied_rows: int
    rows: int
    tied: int
    value: float
    dtype: str

    def describe(self) -> str:
        place = f" at {self.where}" if self.where else ""
        return (f"the reference selects with torch.topk{place} among tied values: in {self.tied_rows} of {self.rows} row(s) its "
                f"last choice (k={self.k} of {self.candidates}) ties with the next candidate (first row: {self.tied} candidates within "
                f"{TIE_ULPS} {self.dtype} ulps of {self.value:.4g}), and torch and XLA keep different tied candidates, so outputs "
                "computed from that selection need not match; random weights tie far more often than trained ones: verify with "
                "the trained weights")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class TiesToLowestIndex(TorchFunctionMode):
    """While active, torch.topk (function and method) keeps the lowest indices among values tied at its
    k-th choice, as XLA's TopK does (module docstring): a stable sort, then its first k."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.topk, torch.Tensor.topk):
            return _topk_lowest_index_first(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _topk_lowest_index_first(values: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """torch.topk's values and indices (in sorted order, which `sorted=False` allows too), ties to the lowest index."""
    order = torch.sort(values, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))


def selection_ties(run: Callable[[], object], model: object = None) -> list[SelectionTie]:
    """Runs `run` (the eager reference on some inputs) and returns its tied top-k selections, one per
    source line, in call order; [] when `run` raises (the failure is then explained elsewhere).

    Args:
      model: what `run` calls; an nn.Module's weights' lowest-precision float dtype sets what counts
        as tied (anything else: each selection's own dtype).
    """
    weights = model.parameters() if isinstance(model, torch.nn.Module) else ()
    dtypes = {tensor.dtype for tensor in weights if tensor.dtype.is_floating_point}
    watch = _TopkWatch(max(dtypes, key=lambda dtype: torch.finfo(dtype).eps, default=None))
    try:
        with torch.no_grad(), watch:
            run()
    except Exception:  # noqa: BLE001 (the user's model may raise anything) the explanation is optional
        return []
    return list(watch.ties.values())


class _TopkWatch(TorchFunctionMode):
    def __init__(self, resolution: torch.dtype | None):
        super().__init__()
        self.resolution = resolution
        self.ties: dict[str, SelectionTie] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in (torch.topk, torch.Tensor.topk):
            try:
                self._check(*args, **kwargs)
            except Exception:  # noqa: BLE001 (a watcher must not fail the model it watches)
                pass
        return result

    def _check(self, values: torch.Tensor, k: int, dim: int = -1, largest: bool = True, *_, **__) -> None:
        """Records the call when its k-th and (k+1)-th values tie (torch.topk's own arguments; the mode
        is off inside its handler, so these ops are not watched)."""
        if not values.dtype.is_floating_point or values.dim() == 0 or k >= values.shape[dim]:
            return
        ordered = values.detach().float().movedim(dim, -1).sort(-1, descending=largest).values.reshape(-1, values.shape[dim])
        kth, following = ordered[:, k - 1], ordered[:, k]
        coarsest = max((values.dtype, self.resolution or values.dtype), key=lambda dtype: torch.finfo(dtype).eps)
        ulp = torch.finfo(coarsest).eps * kth.abs().clamp(min=torch.finfo(coarsest).tiny)
        tied = (kth - following).abs() <= TIE_ULPS * ulp
        if not bool(tied.any()):
            return
        row = int(tied.nonzero()[0, 0])
        close = int(((ordered[row] - kth[row]).abs() <= TIE_ULPS * ulp[row]).sum())
        where = _model_line()
        if where not in self.ties:
            self.ties[where] = SelectionTie(where, int(k), int(ordered.shape[1]), int(tied.sum()), int(ordered.shape[0]), close,
                                            float(kth[row]), str(coarsest).removeprefix("torch."))


def _model_line() -> str:
    """The innermost caller outside torch and tpuexport ("file.py:12 (code)"), or ""."""
    frame = inspect.currentframe()
    while frame is not None:
        path = frame.f_code.co_filename
        if not os.path.abspath(path).startswith((_TORCH_DIR, _PACKAGE_DIR)) and not path.startswith("<"):
            return f"{os.path.basename(path)}:{frame.f_lineno} ({linecache.getline(path, frame.f_lineno).strip()})"
        frame = frame.f_back
    return ""
