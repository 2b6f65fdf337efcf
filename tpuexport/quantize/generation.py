"""The quantize pass of a text-generation conversion: PT2E int8 per entry point (prefill and decode, or
the paged step), one set of quantized weights.

Each entry point is quantized on its own (`quantization.quantize`, the same TpuQuantizer), with
its own activation observers calibrated on what a serving engine feeds it:

  prefill  calibration prompts, right-padded to a prefill bucket, a batch of rows at a time, each
           written into its own cache slot;
  decode   DECODE_STEPS greedy steps after each prefill batch, over the cache prefill filled, every
           row at its own position (the other slots idle at position 0).
  step     (--kv-cache paged) the prompts max batch rows at a time, prefilled in chunks that share the
           largest token budget, each row then decoding DECODE_STEPS greedy tokens beside the other
           rows' chunks: every step planned as the runtime plans it (export/step_work.py).

The calibration run is the float model's (a prepared PT2E module computes in float), so the
decode samples see the cache a float prefill writes. Weights are quantized per output channel by
a min/max observer of the weight alone, so both entry points round every weight identically; the
pass checks that they do (one weights file serves both). The KV cache stays in the model's dtype.

Calibration prompts come from a file (.npz / .safetensors: "tokens" [N, seq] integer, optional
"lengths" [N], each row's first lengths[i] tokens being its prompt), from the API (a list of
token-id sequences), or are random token ids with --random-calibration (warned). int8-dynamic
computes activation scales at run time and needs no calibration; random prompts then only feed
the quantization report's evaluation samples.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Iterable

import numpy as np
import torch
from torch.utils import _pytree as pytree

from tpuexport.errors import TpuExportError
from tpuexport.export import CapturedModel, GenerationSpec, PagedSpec
from tpuexport.export.step_work import plan_step, step_inputs
from tpuexport.quantize.calibration import _read_arrays
from tpuexport.quantize.quantization import MAX_EVALUATION_SAMPLES, RANDOM_CALIBRATION_WARNING, QuantizedModel, quantize

# Decode steps calibrated after each prefill batch (each one a sample holding a whole cache).
DECODE_STEPS = 4
# Random calibration prompts (--random-calibration, or int8-dynamic's evaluation samples).
RANDOM_PROMPTS = 4
# At most this many prompts are used (each decode sample holds a copy of the cache).
MAX_PROMPTS = 8


def quantize_entry_points(captured: dict[str, CapturedModel], spec: GenerationSpec, mode: str, calibration: Iterable | None = None,
                          calibration_file: pathlib.Path | None = None, random_calibration: bool = False) -> dict[str, QuantizedModel]:
    """Quantizes every entry point of a text-generation program with PT2E (module docstring).

    Args:
      captured: {entry point: its float CapturedModel}; the references are the float entry-point modules.
      spec: the cache and its limits.
      mode: "int8" (static, calibrated) or "int8-dynamic".
      calibration: calibration prompts from the API (token-id sequences), or None.
      calibration_file: a .npz / .safetensors file of prompts (wins over `calibration`), or None.
      random_calibration: calibrate static int8 on random prompts when none are given.
    Returns:
      {entry point: QuantizedModel}, their programs holding the same quantized weights.
    Raises:
      TpuExportError: an unknown mode, missing or malformed calibration prompts, a failed
        re-export, or entry points whose quantized weights differ.
    """
    if mode not in ("int8", "int8-dynamic"):
        raise TpuExportError(f"--quantize {mode} does not apply to text generation here; use int8, int8-dynamic, "
                             "int8-weight-only or int4-weight-only")
    prompts, source = calibration_prompts(spec, mode, calibration, calibration_file, random_calibration)
    modules = {name: entry.reference for name, entry in captured.items()}
    samples = ({"step": step_samples(modules["step"], spec, prompts)} if isinstance(spec, PagedSpec)
               else entry_point_samples(modules, spec, prompts))
    quantized = {}
    for name, entry in captured.items():
        result = quantize(entry, mode, calibration=samples[name])
        counted = len(samples[name]) if mode == "int8" else 0
        # Evaluated on served inputs only: the entry points' example inputs (tokens of ones, an empty
        # cache, every slot at position 0) are placeholders for export, not inputs a server sends.
        quantized[name] = dataclasses.replace(result, calibration_source=source if mode == "int8" else "none",
                                              calibration_samples=counted,
                                              evaluation_samples=tuple(samples[name][:MAX_EVALUATION_SAMPLES + 1]),
                                              warnings=(RANDOM_CALIBRATION_WARNING,) if mode == "int8" and source == "random" else ())
    check_same_weights(quantized)
    return quantized


def calibration_prompts(spec: GenerationSpec, mode: str, calibration, calibration_file, random_calibration) -> tuple[list[list[int]], str]:
    """(prompts, source): the prompts to calibrate (static) or evaluate (dynamic) on.

    Raises:
      TpuExportError: static int8 without prompts or --random-calibration; malformed prompts.
    """
    if calibration_file is not None:
        return _check_prompts(_file_prompts(pathlib.Path(calibration_file)), spec, f"calibration file {calibration_file}"), "file"
    if calibration is not None:
        prompts = [[int(token) for token in (prompt.tolist() if isinstance(prompt, (torch.Tensor, np.ndarray)) else prompt)]
                   for prompt in calibration]
        return _check_prompts(prompts, spec, "calibration"), "api"
    if mode == "int8" and not random_calibration:
        raise TpuExportError("static int8 text generation needs calibration prompts: --calibration FILE (.npz/.safetensors with a "
                             "'tokens' array [N, seq] and optional 'lengths' [N]), calibration=[[ids...], ...] in the API, or "
                             "--random-calibration to accept random tokens (or use --quantize int8-dynamic)")
    generator = np.random.default_rng(0)
    first_budget = spec.token_buckets[-1] if isinstance(spec, PagedSpec) else spec.prefill_buckets[0]
    longest = max(2, min(first_budget, spec.max_context - DECODE_STEPS))
    # Down to one token: decode's early positions (few keys) have their own activation ranges.
    lengths = np.linspace(longest, 1, RANDOM_PROMPTS).round().astype(int)
    return [[int(token) for token in generator.integers(0, spec.vocab, length)] for length in lengths], "random"


def _file_prompts(path: pathlib.Path) -> list[list[int]]:
    arrays = _read_arrays(path)
    tokens = arrays.get("tokens")
    if tokens is None or tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer) or set(arrays) - {"tokens", "lengths"}:
        raise TpuExportError(f"calibration file {path} holds {sorted(arrays)}; for text generation store an integer array 'tokens' "
                             "[N, seq] and optionally 'lengths' [N] (each prompt's length)")
    lengths = arrays.get("lengths", np.full(tokens.shape[0], tokens.shape[1]))
    if lengths.shape != (tokens.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
        raise TpuExportError(f"calibration file {path}: 'lengths' must be an integer array [{tokens.shape[0]}] (one length per prompt)")
    return [[int(token) for token in row[:int(length)]] for row, length in zip(tokens, lengths)]


def _check_prompts(prompts: list[list[int]], spec: GenerationSpec, where: str) -> list[list[int]]:
    """The prompts, at most MAX_PROMPTS, each clipped to what prefill and DECODE_STEPS leave room for."""
    if not prompts:
        raise TpuExportError(f"{where}: no prompt given; give at least one token-id sequence")
    # Over pages a prompt of any length is prefilled in chunks.
    longest = spec.max_context - DECODE_STEPS
    if not isinstance(spec, PagedSpec):
        longest = min(spec.prefill_buckets[-1], longest)
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise TpuExportError(f"{where}: prompt {index} is empty; give at least one token per prompt")
        bad = [token for token in prompt if not 0 <= token < spec.vocab]
        if bad:
            raise TpuExportError(f"{where}: prompt {index} holds token id {bad[0]}, outside the vocabulary 0..{spec.vocab - 1}")
    return [prompt[:longest] for prompt in prompts[:MAX_PROMPTS]]


def entry_point_samples(modules: dict, spec: GenerationSpec, prompts: list[list[int]]) -> dict[str, list[tuple[torch.Tensor, ...]]]:
    """Each entry point's inputs as a serving engine drives them (module docstring), with the float modules.

    Args:
      modules: {"prefill": float Prefill module, "decode": float Decode module}.
      spec: the cache and its limits.
      prompts: token-id sequences (each fits a prefill bucket and leaves DECODE_STEPS positions).
    Returns:
      {entry point: input tuples in its signature order}.
    """
    samples = {"prefill": [], "decode": []}
    with torch.no_grad():
        for start in range(0, len(prompts), spec.max_batch):
            batch = prompts[start:start + spec.max_batch]
            longest = max(len(prompt) for prompt in batch)
            seq = next(size for size in spec.prefill_buckets if size >= longest)
            tokens = torch.zeros((len(batch), seq), dtype=torch.long)
            for row, prompt in enumerate(batch):
                tokens[row, :len(prompt)] = torch.tensor(prompt)
            lengths = torch.tensor([len(prompt) for prompt in batch])
            slots = torch.arange(len(batch))
            cache = tuple(torch.zeros(shape, dtype=getattr(torch, name)) for shape, name in spec.cache_tensors().values())
            samples["prefill"].append((tokens, lengths, slots, *cache))
            logits, *cache = _outputs(modules["prefill"](tokens, lengths, slots, *cache))
            step_tokens = torch.zeros(spec.max_batch, dtype=torch.long)
            positions = torch.zeros(spec.max_batch, dtype=torch.long)
            step_tokens[:len(batch)], positions[:len(batch)] = logits.argmax(-1), lengths
            for _ in range(DECODE_STEPS):
                samples["decode"].append((step_tokens.clone(), positions.clone(), *cache))
                logits, *cache = _outputs(modules["decode"](step_tokens, positions, *cache))
                step_tokens[:len(batch)] = logits[:len(batch)].argmax(-1)
                positions[:len(batch)] += 1
    return samples


def step_samples(step: torch.nn.Module, spec: PagedSpec, prompts: list[list[int]]) -> list[tuple[torch.Tensor, ...]]:
    """The paged step's inputs as a server drives it (module docstring), with the float step module.

    Each group of rows gets pages of its own, as few as its prompts and decode steps take (the pages dim
    is dynamic, at least one row of max context): each sample then holds a cache of that size, not the
    artifact's.
    """
    samples = []
    budget = spec.token_buckets[-1]
    with torch.no_grad():
        for start in range(0, len(prompts), spec.max_batch):
            group = prompts[start:start + spec.max_batch]
            pages, taken = {}, 0
            for row, prompt in enumerate(group):
                needed = math.ceil((len(prompt) + DECODE_STEPS) / spec.page_size)
                pages[row], taken = list(range(taken, taken + needed)), taken + needed
            cache = [torch.zeros((shape[0], max(2, spec.pages_per_row, taken), *shape[2:]), dtype=getattr(torch, name))
                     for shape, name in spec.cache_tensors().values()]
            prompts_left, decoding = {row: list(prompt) for row, prompt in enumerate(group)}, {}
            lengths, decoded = dict.fromkeys(pages, 0), dict.fromkeys(pages, 0)
            rows = min(size for size in spec.row_buckets if size >= len(group))
            while prompts_left or decoding:
                work = plan_step(prompts_left, decoding, budget, max(1, budget // len(group)))
                for row, tokens in work.items():
                    lengths[row] += len(tokens)
                count = sum(len(tokens) for tokens in work.values())
                inputs = step_inputs(spec, work, lengths, pages, min(size for size in spec.token_buckets if size >= count), rows)
                samples.append((*(torch.from_numpy(array) for array in inputs), *cache))
                logits, *cache = _outputs(step(*samples[-1]))
                for row in work:
                    if prompts_left.get(row):
                        continue
                    prompts_left.pop(row, None)
                    decoded[row] += 1
                    if decoded[row] <= DECODE_STEPS:
                        decoding[row] = int(logits[row].argmax())
                    else:
                        decoding.pop(row, None)
    return samples


def _outputs(result) -> list[torch.Tensor]:
    """An entry point's outputs (logits, cache_k, cache_v) as a flat list."""
    return pytree.tree_leaves(result)


def check_same_weights(quantized: dict[str, QuantizedModel]) -> None:
    """Checks that every entry point's quantized program holds the same weights (names and values).

    Raises:
      TpuExportError: a weight differs (the artifact stores one set for all entry points).
    """
    states = {name: {**result.captured.program.state_dict, **result.captured.program.constants} for name, result in quantized.items()}
    (first, first_state), *others = states.items()
    for name, state in others:
        if state.keys() != first_state.keys():
            differing = sorted(state.keys() ^ first_state.keys())
            raise TpuExportError(f"the quantized {first} and {name} entry points hold different weights ({differing[0]}, ...); "
                                 "report this with the model to tpuexport")
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not torch.equal(value, first_state[key]):
                raise TpuExportError(f"the quantized {first} and {name} entry points rounded weight {key} differently; "
                                     "report this with the model to tpuexport")
