"""The Python API's conversion entry points, `tpuexport.convert` and `tpuexport.plan` (re-exported,
lazily, by tpuexport/__init__.py)."""

from __future__ import annotations

import os
import pathlib
from typing import Sequence

import torch

from tpuexport.artifact import Artifact
from tpuexport.compile import make_request
from tpuexport.errors import TpuExportError
from tpuexport.export import DEFAULT_CACHE_LAYOUT, LoadedSource, SourceInfo, open_checkpoint
from tpuexport.export.huggingface import forward_without_cache
from tpuexport.memory import memory_budget
from tpuexport.pipeline import ConversionOptions, run_conversion
from tpuexport.verify import DEFAULT_BUDGET_FLOPS, DEFAULT_NEW_TOKENS


def convert(
    model,
    args: tuple | None = None,
    dynamic_shapes=None,
    *,
    target="v5e",
    out,
    buckets: dict[str, list[int]] | None = None,
    precision: str = "auto",
    matmul_precision: str = "default",
    kernels: str = "auto",
    tolerances: dict[str, float] | tuple[float, float] | None = None,
    verify_budget_flops: float = DEFAULT_BUDGET_FLOPS,
    memory_budget_gb: float | None = None,
    verify_sizes: list[dict[str, int]] | None = None,
    overwrite: bool = False,
    scan: bool = True,
    saved_model: bool = True,
    model_name: str | None = None,
    model_version: int = 1,
    quantize: str | None = None,
    group_size: int = 128,
    keep_float: str | None = None,
    calibration=None,
    random_calibration: bool = False,
    mesh: str | dict[str, int] | None = None,
    sharding: str | None = None,
    rules=(),
    input_rules=(),
    progress=None,
    weights: bool = True,
    checkpoint=None,
    task: str = "forward",
    max_context: int | None = None,
    max_batch: int = 1,
    cache_layout: str = DEFAULT_CACHE_LAYOUT,
    kv_cache_dtype: str = "model",
    sliding_window_cache: str = "bounded",
    kv_cache: str = "static",
    page_size: int | None = None,
    num_pages: int | None = None,
    verify_new_tokens: int = DEFAULT_NEW_TOKENS,
    compile_envs: Sequence[str | os.PathLike] = (),
) -> Artifact:
    """Converts a PyTorch model into a verified TPU artifact directory.

    Args:
      model: an nn.Module (with `args` and `dynamic_shapes` in torch.export's own format) or a
        torch.export.ExportedProgram (which carries its own example inputs and dims). A transformers
        model's forward is called as a directory's is: `args` are its first forward arguments by
        name, no cache is built, and the outputs are its output tensors by field name ("logits").
      args: example positional inputs for an nn.Module.
      dynamic_shapes: torch.export dynamic_shapes (torch.export.Dim objects name the dims).
      target: a TPU target name or a list of them: single chips ("v4", "v5e", "v5p", "v6e", "7x")
        or slices ("v5e-8", "v5p-8", "v6e-8", "7x-8", ...; see SLICES).
      out: the artifact directory to create.
      buckets: {dim name: [sizes]} compiled as a cartesian product; None for the example shapes.
      precision: "auto" (the model's own dtypes tensor by tensor: bf16 parameters stay bf16, f32
        buffers stay f32), "f32", "bf16" (all bfloat16 but for state the model keeps in f32) or
        "bf16-mixed" (autocast-like); docs/precision.md.
      matmul_precision: the TPU arithmetic of dots and convolutions, pinned in the artifact and
        emulated by verification: "default" (one bf16 pass), "high" (bf16x3), "highest" (f32).
      kernels: "auto" (each single-chip TPU executable uses Pallas flash attention where it reads
        fewer bytes, verified in interpret mode on CPU; docs/kernels.md) or "none" (the
        kernel-free program everywhere).
      tolerances: verification overrides, {"atol": ..., "rtol": ..., "scale_tol": ...} or
        (atol, rtol); None for the defaults of the numeric settings (docs/verification.md).
      verify_budget_flops: matmul FLOPs the optional verification sizes may add.
      memory_budget_gb: what the converting process may hold, in GB (10^9 bytes): verification's
        optional runs are shrunk or skipped to stay within it (docs/verification.md); None: the
        process's resident memory at the start plus 3/4 of the machine's MemAvailable.
      verify_sizes: dim sizes that must also be verified, e.g. [{"batch": 64, "seq": 512}].
      overwrite: replace an existing artifact at `out`.
      scan: lower runs of identical blocks (a model's layers: BERT's, Llama's, ViT's) as one scan each,
        their weights stacked (manifest "scanned" maps them to state_dict names); False unrolls them.
      saved_model: also write a TF Serving SavedModel under tf_serving/ (checked in TensorFlow).
      model_name: TF Serving's model name; None for the stem of `out` ("mlp" for "mlp.tpu").
      model_version: TF Serving's version directory (tf_serving/<name>/<version>).
      quantize: None, "int8" (static) or "int8-dynamic" (PT2E int8), "int8-weight-only" or
        "int4-weight-only" (weights only, also with `checkpoint`; see docs/quantization.md).
      group_size: int4-weight-only's elements per bfloat16 scale along the contraction dim.
      keep_float: a regex over state_dict names of weights that weight-only quantization keeps
        float (e.g. "lm_head"); None quantizes every matmul and embedding weight.
      calibration: for "int8": an iterable of example-args tuples [(x,), ...], or a path to a .npz /
        .safetensors file (one array per input name, samples on axis 0). With task="text-generation":
        calibration prompts, a list of token-id sequences, or a file holding "tokens" [N, seq] and
        optional "lengths" [N] (quantize/generation.py).
      random_calibration: allow "int8" without calibration data, calibrated on random inputs (warned).
      mesh: the slice's device mesh, "data=2,model=4" or {"data": 2, "model": 4}; sizes multiply
        to the slice's device count. None: the preset's one-axis mesh.
      sharding: a preset for slices: "replicated" (default), "data-parallel", "tensor-parallel", "fsdp".
      rules: weight layouts applied after the preset, later ones winning: "REGEX=SPEC" strings,
        (regex, spec) pairs or a {regex: spec} dict; regexes search state_dict names, a spec gives
        each leading dim a mesh axis or None, e.g. ("model", None) or "model,None".
      input_rules: input layouts in the same forms, keyed by input name.
      progress: optional callable (stage, seconds, detail) called as each stage ends.
      weights: False for a plan (see `plan`); the verification, quantization and SavedModel
        arguments then do not apply.
      checkpoint: stream the weights from here instead of the model (which may then have its
        parameters on the meta device, e.g. built within `tpuexport.parameters_on_meta()`): a
        .safetensors file, a sharded checkpoint directory, a .pt state_dict, or a Mapping name ->
        tensor read one tensor at a time. No more than a few tensors are in memory at once. With
        task "text-generation" too (streamed once for both entry points).
      task: "forward" (the model's forward as one program) or "text-generation": `model` is a
        Hugging Face causal LM (no args), and the artifact holds entry points prefill, decode and sample
        over a KV cache of max_batch x max_context (docs/generation.md); `buckets` then
        takes prefill's {"seq": prompt lengths, "batch": batch sizes}; no SavedModel is written.
      max_context: positions per cache slot (text-generation); None: what the model's config
        allows (its max_position_embeddings, as the command line defaults it for a directory).
      max_batch: cache slots, decode's batch (text-generation).
      cache_layout: "layer_batch_head_pos" (default) or "layer_batch_pos_head" (text-generation).
      kv_cache_dtype: "model" (default: the model's dtype) or "int8" (int8 keys and values with
        per-(layer, slot, kv-head, position) scales; text-generation).
      sliding_window_cache: "bounded" (default: W positions per slot, a ring, when every layer
        attends within one sliding window W < max_context) or "full" (max_context positions).
      kv_cache: "static" (default: prefill and decode over max_batch x max_context) or "paged" (one
        step entry point over pages; `buckets` then takes {"tokens": budgets, "rows": row counts};
        docs/generation.md#a-paged-kv-cache).
      page_size, num_pages: the paged cache's positions per page (default 16) and pages, for every
        target (default: per TPU target what its HBM holds beside the largest step bucket, found by
        compiling it; CPU targets and verification: max_batch rows of max_context; docs/paged-cache.md).
      verify_new_tokens: tokens each verification prompt generates (text-generation).
      compile_envs: Python interpreters of other environments (a serving image's jax, jaxlib and
        libtpu): every target is also compiled there, and the artifact carries executables per
        version set; the runtime loads the set matching its host (docs/compile-environments.md).
    Returns:
      The Artifact written at `out`.
    Raises:
      TpuExportError: bad input, including a model whose weights are on the meta device with
        `weights` True; nothing is written.
      VerificationError: the conversion (or its SavedModel) does not match eager PyTorch; nothing
        but the report is written.
    """
    if isinstance(tolerances, tuple):
        tolerances = dict(zip(("atol", "rtol"), tolerances))
    if task != "text-generation" and not isinstance(model, torch.export.ExportedProgram) and args is None:
        raise TpuExportError("convert(model) needs args=(example inputs,) for an nn.Module")
    opened = open_checkpoint(checkpoint) if checkpoint is not None else None
    if task == "forward" and opened is None:  # with a checkpoint, the model's own names are the checkpoint's
        model = forward_without_cache(model, len(args or ()))
    loaded = LoadedSource(model, tuple(args) if args is not None else None, dynamic_shapes, None,
                          SourceInfo("api", checkpoint=opened.name if opened else None), checkpoint=opened)
    targets = (target,) if isinstance(target, str) else tuple(target)
    calibration_file = pathlib.Path(calibration) if isinstance(calibration, (str, pathlib.Path)) else None
    options = ConversionOptions(
        targets, pathlib.Path(out), buckets=buckets, precision=precision, matmul_precision=matmul_precision, kernels=kernels,
        tolerance_overrides=dict(tolerances or {}), verify_budget_flops=verify_budget_flops, verify_sizes=tuple(verify_sizes or ()),
        overwrite=overwrite, scan=scan, saved_model=saved_model, model_name=model_name, model_version=model_version,
        quantize=quantize, group_size=group_size, keep_float=keep_float, calibration=None if calibration_file else calibration, calibration_file=calibration_file,
        random_calibration=random_calibration, sharding=make_request(mesh, sharding, rules, input_rules), weights=weights,
        task=task, max_batch=max_batch, max_context=max_context, cache_layout=cache_layout, kv_cache_dtype=kv_cache_dtype,
        sliding_window_cache=sliding_window_cache, kv_cache=kv_cache, page_size=page_size, num_pages=num_pages,
        new_tokens=verify_new_tokens, compile_envs=tuple(str(python) for python in compile_envs),
        memory_budget=memory_budget(memory_budget_gb),
    )
    return run_conversion(loaded, options, progress)


def plan(
    model,
    args: tuple | None = None,
    dynamic_shapes=None,
    *,
    target="v5e",
    out,
    buckets: dict[str, list[int]] | None = None,
    precision: str = "auto",
    matmul_precision: str = "default",
    kernels: str = "auto",
    overwrite: bool = False,
    mesh: str | dict[str, int] | None = None,
    sharding: str | None = None,
    rules=(),
    input_rules=(),
    progress=None,
    quantize: str | None = None,
    group_size: int = 128,
) -> Artifact:
    """Plans a model without its weights: lowered from the weights' shapes and dtypes, compiled for
    every target and bucket (slices with the sharding plan), with XLA's per-chip memory and an
    HBM-fit verdict. For models larger than the build machine, built on the meta device:

        with torch.device("meta"):
            model = LlamaForCausalLM(config)

    No weight is read or allocated, nothing is verified; the artifact has the program and the
    executables, no weights, golden data or SavedModel, and its manifest says "plan_only": true.

    Args:
      model, args, dynamic_shapes, target, out, buckets, precision, matmul_precision, kernels, overwrite,
      mesh, sharding, rules, input_rules, progress: as for `convert` (example inputs may be real
        CPU tensors or meta tensors).
      quantize, group_size: None, or a weight-only mode ("int8-weight-only", "int4-weight-only")
        planned with the quantized weights' shapes and dtypes (the PT2E modes need the weights).
    Returns:
      The plan-only Artifact written at `out`.
    Raises:
      TpuExportError: bad input, or a bucket that does not fit a device's HBM (naming the
        largest buffers); nothing is written.
    """
    return convert(model, args, dynamic_shapes, target=target, out=out, buckets=buckets, precision=precision,
                   matmul_precision=matmul_precision, kernels=kernels, overwrite=overwrite, saved_model=False, mesh=mesh, sharding=sharding,
                   rules=rules, input_rules=input_rules, progress=progress, weights=False, quantize=quantize, group_size=group_size)

