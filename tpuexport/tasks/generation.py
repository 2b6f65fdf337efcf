"""The text-generation task: a Hugging Face causal LM as prefill and decode entry points over a KV cache
(export/generation.py) and a sample entry point that draws the next tokens from their logits
(export/sampling.py, weightless), an encoder-decoder as encode and decode over a self-attention and
a cross-attention cache (export/seq2seq.py); verified by greedy generation against generate().

  verify   greedy generation vs Hugging Face generate, teacher-forced, both CPU runs (PT2E int8:
           vs the PT2E entry points, verify/quantized_generation.py; an int8 cache: vs the eager
           int8-cache entry points, verify/int8_kv_generation.py; weight-only: vs the model with its
           weights rounded as the artifact rounds them, its distance from the float model measured)
  verify sampling  the sample entry point exactly against a NumPy reference of its algorithm, and
           statistically against Hugging Face's logits processors (verify/sampling.py)
  verify sharded  per slice plan, a verified case's fill and decode steps partitioned on N CPU
           devices, the cache carried between calls, vs the same references (verify/sharded_generation.py)

With a checkpoint, the eager model generate() runs is a copy of the model whose parameters are the
checkpoint's memory-mapped tensors (export.with_checkpoint_weights), and the program's are the
artifact's weights file, memory-mapped: neither is a copy the process owns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib

import torch

from tpuexport import artifact as artifact_stage
from tpuexport import compile as compile_stage
from tpuexport.arrays import load_arrays
from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport import verify as verify_stage
from tpuexport.errors import TpuExportError, VerificationError
from tpuexport.export.generation import cached_shapes
from tpuexport.export.huggingface import generation_context
from tpuexport.export.cache_specs import PAGES_DIM
from tpuexport.tasks.conversion import (META_WEIGHTS_ERROR, PT2E_CHECKPOINT_ERROR, Conversion, describe_precision, verification_tolerances,
                                        verification_failure, write_failed_report)
from tpuexport.tasks.page_count import PageSizing
from tpuexport.tasks.spec import EntryPointSpec, ProgramSpec, Task, Verified
from tpuexport.verify.generation import replay_golden
from tpuexport.verify.paged_generation import replay_golden as replay_paged_golden
from tpuexport.verify.seq2seq import replay_golden as replay_seq2seq_golden

# Why decode keeps XLA's attention: its query is one token over the whole cache (flash's blocks are
# query-by-key tiles); a ragged/paged decode kernel reads the cache in the layout it pages.
DECODE_KERNEL_REASON = ("decode: one query per row over the KV cache; the flash kernel tiles queries, and a ragged/paged "
                        "decode attention kernel is not used yet")
# Why the paged step keeps XLA's attention (docs/generation.md#a-paged-kv-cache).
PAGED_KERNEL_REASON = ("step: the reference paged attention (gather by page table, masked); JAX's Pallas ragged_paged_attention (0.10.2 "
                       "to 0.12.0.1) does not run in Pallas interpret mode on CPU, so it cannot be verified here, and needs head_dim a multiple of 128")
SAMPLE_KERNEL_REASON = "sample: no attention (it draws tokens from logits)"
ENCODER_DECODER_KERNEL_REASON = "encoder-decoder entry points keep XLA's attention (kernels are not lowered for them yet)"
# Generation entry points run at their compiled sizes: rows go to cache slots, never padded by the runtime.
EXACT_SIZES = (None, "generation entry points run at their compiled sizes")


@dataclasses.dataclass(frozen=True)
class GenerationSources:
    """What quantization and verification need beside the entry points: the cache's spec, the user's
    model, the eager entry-point modules over it, and with a checkpoint the model holding the
    checkpoint's tensors."""

    spec: object
    model: torch.nn.Module
    modules: dict[str, torch.nn.Module]
    checkpoint_model: torch.nn.Module | None


class TextGenerationTask(Task):
    name = "text-generation"

    def check(self, conversion: Conversion) -> None:
        options, model = conversion.options, conversion.loaded.model
        if not isinstance(model, torch.nn.Module):
            raise TpuExportError(f"--task text-generation needs the nn.Module of a Hugging Face causal LM, not a {type(model).__name__}")
        if options.max_context is None:
            if getattr(model, "config", None) is None:
                raise TpuExportError("--task text-generation needs --max-context N (positions per cache slot), e.g. --max-context 2048")
            # A Hugging Face config says how far its positions go, as for a directory source.
            conversion.options = dataclasses.replace(options, max_context=generation_context(model))
        streamed = conversion.loaded.checkpoint is not None and not conversion.plan_only
        if not conversion.plan_only and not streamed and export_stage.weights_on_meta(model):
            raise TpuExportError(f"{META_WEIGHTS_ERROR} (tpuexport.plan or convert(weights=False) in Python)")
        if streamed and options.pt2e:
            raise TpuExportError(PT2E_CHECKPOINT_ERROR)
        if options.kv_cache == "paged":
            _check_paged(conversion)
        if export_stage.is_encoder_decoder(model):
            unsupported = [what for what, given in (("--quantize", options.quantize), ("--checkpoint", conversion.loaded.checkpoint is not None),
                                                     ("--kv-cache-dtype int8", options.kv_cache_dtype == "int8"),
                                                     ("a slice target", conversion.slices), ("a plan (--no-weights)", conversion.plan_only))
                           if given]
            if unsupported:
                raise TpuExportError(f"--task text-generation of an encoder-decoder ({type(model).__name__}) does not support "
                                     f"{unsupported[0]} yet; convert it in float on single-chip targets with its weights")

    def specify(self, conversion: Conversion) -> ProgramSpec:
        options, loaded = conversion.options, conversion.loaded
        requested = dict(options.buckets or {})
        if options.kv_cache == "paged":
            return _paged_spec(conversion, requested)
        unknown = sorted(set(requested) - {"batch", "seq"})
        encoder_decoder = export_stage.is_encoder_decoder(loaded.model)
        fill = "encode" if encoder_decoder else "prefill"
        if unknown:
            raise TpuExportError(f"--bucket {unknown[0]} is not a dim of {'encoder-decoder generation' if encoder_decoder else 'text generation'}; "
                                 f"{fill}'s dims are batch and seq ({'source' if encoder_decoder else 'prompt'} length)")
        batches = tuple(sorted(set(requested.get("batch") or {1, options.max_batch})))
        if not all(1 <= batch <= options.max_batch for batch in batches):
            raise TpuExportError(f"--bucket batch={','.join(map(str, batches))} is out of range: {fill} batches are 1..{options.max_batch} "
                                 "(--max-batch)")
        seq = tuple(requested["seq"]) if "seq" in requested else None
        return _seq2seq_spec(conversion, seq, batches) if encoder_decoder else _decoder_spec(conversion, seq, batches)

    def quantize(self, conversion: Conversion) -> dict:
        from tpuexport.quantize.generation import quantize_entry_points

        options = conversion.options
        with conversion.clock.stage("quantize", lambda: "; ".join(f"{name} {result.describe()}" for name, result in quantized.items())):
            readers = {name: captured for name, captured in conversion.captured.items() if conversion.spec.entry_points[name].reads_weights}
            quantized = quantize_entry_points(readers, conversion.spec.state.spec, options.quantize, options.calibration,
                                              options.calibration_file, options.random_calibration)
        return quantized

    def input_rules(self, conversion: Conversion, entry_point: str, mesh: dict[str, int]) -> tuple:
        """The KV cache laid out by the preset: its kv-heads axis on the model axis (tensor-parallel),
        its batch axis on the data axis (data-parallel, fsdp, or a tensor-parallel mesh with a data axis).
        The sample entry point takes the logits whole, as a multi-host slice's fill and decode give them:
        split, the runtime would reshard them at every step, a program JAX compiles at run time."""
        if entry_point == "sample":
            return (("logits", ()),)
        spec, preset = conversion.program.spec, conversion.options.sharding.preset
        inputs = [tensor.name for tensor in conversion.program.entry_points[entry_point].signature.inputs]
        if isinstance(conversion.program, lower_stage.PagedGenerationProgram):
            return _paged_input_rules(spec, preset, mesh, inputs)
        heads = 2 if spec.layout == "layer_batch_head_pos" else 3
        cache_spec = [None] * len(spec.cache_shape)
        if preset == "tensor-parallel" and "model" in mesh:
            cache_spec[heads] = "model"
        if "data" in mesh and preset in ("data-parallel", "fsdp", "tensor-parallel"):
            cache_spec[1] = "data"
        # An int8 cache's scales ([layers, batch, kv_heads, context]) split alike: heads on axis 2, batch on 1.
        scale_spec = [None, cache_spec[1], cache_spec[heads], None]
        # The sliding layers' rings (a model mixing full and sliding layers) split as the cache does.
        caches = export_stage.CACHE_INPUTS + export_stage.WINDOW_CACHE_INPUTS
        # Short-convolution states ([conv layers, batch, channels, kernel]), recurrent states ([recurrent
        # layers, batch, ...]) and indexer keys ([indexed layers, batch, 1, context, width]) split by rows
        # only: a slot's state whole.
        per_row = {name: [None, cache_spec[1], None, None] for name in export_stage.CONV_STATE_INPUTS}
        per_row.update({name: [None, cache_spec[1], None, None, None] for name in export_stage.INDEXER_KEYS_INPUTS})
        per_row.update({name: [None, cache_spec[1], *[None] * len(spec.recurrent_state)] for name in export_stage.RECURRENT_STATE_INPUTS})
        return (tuple((name, tuple(cache_spec)) for name in spec.cache_inputs if name in caches and name in inputs)
                + tuple((name, tuple(per_row[name])) for name in spec.cache_inputs if name in per_row and name in inputs)
                + tuple((name, tuple(scale_spec)) for name in spec.cache_inputs if name in export_stage.CACHE_SCALE_INPUTS and name in inputs))

    def verify(self, conversion: Conversion) -> Verified:
        program, options, clock = conversion.program, conversion.options, conversion.clock
        report = None
        fill = program.fill_entry_point
        from tpuexport.verify import quantization_report  # imports torchao: only where a section is written

        int8_kv = options.kv_cache_dtype == "int8"
        fix = quantization_report.generation_fix(conversion.weight_only.bits if conversion.weight_only else None, int8_kv)
        with clock.stage("verify", lambda: describe_generation(report, fill, fix)):
            report = _verify_generation(conversion)
        if not report.passed:
            raise verification_failure(report, options.out, conversion.spec.state.model, lambda: (_reference_prompt(conversion),))
        writers = _verify_sampling(conversion, report)
        sharded = _verify_slices(conversion, report)
        logits = _logits_sqnr(report.float_divergence())
        if conversion.weight_only is not None:
            writers += (lambda staging: {"quantization": quantization_report.weight_only_section(
                program.weights_program, conversion.weight_only, measured_outputs=logits, fix=fix)},)
        elif int8_kv and not conversion.quantized:
            writers += (lambda staging: {"quantization": quantization_report.int8_kv_section(logits)},)
        if conversion.quantized:
            writers += (_int8_report(conversion, report),)
        return Verified(report, tuple(sharded), {name: EXACT_SIZES for name in program.entry_points}, writers)

    def replay_golden(self, artifact, tolerances):
        """The stored cases' fill and decode steps, teacher-forced, against generate()'s tokens and logits."""
        golden = load_arrays(artifact.read_checked(artifact.manifest["verification"]["golden"]))
        program = artifact.generation_program
        replay = (replay_seq2seq_golden if isinstance(program, lower_stage.Seq2SeqProgram)
                  else replay_paged_golden if isinstance(program, lower_stage.PagedGenerationProgram) else replay_golden)
        return replay(program, golden, artifact.manifest["verification"]["cases"], tolerances)

    def describe_golden(self, report) -> str:
        return f"{len(report.cases)} stored generation case(s), {report.tokens_compared()} tokens, match generate()'s tokens and logits"

    def target_sizes(self, conversion: Conversion, entry_points: dict):
        """A paged program without --num-pages: each TPU target's pages, what its HBM holds (tasks/page_count.py)."""
        if not isinstance(conversion.program, lower_stage.PagedGenerationProgram) or conversion.options.num_pages is not None:
            return None
        return PageSizing(conversion.program.spec, entry_points["step"])

    def bucket_figures(self, conversion: Conversion):
        spec = conversion.program.spec
        if isinstance(conversion.program, lower_stage.PagedGenerationProgram):
            sized = getattr(conversion.target_sizes, "sized", {})
            return lambda name, result: ({"paged_step": paged_step_figures(result, spec, sized.get(result.target.name))} if name == "step"
                                         else {})
        return lambda name, result: {"decode_step": decode_step_figures(result, spec)} if name == "decode" else {}


def _decoder_spec(conversion: Conversion, seq: tuple[int, ...] | None, batches: tuple[int, ...]) -> ProgramSpec:
    """Prefill and decode over one model; with a checkpoint, both exported on the meta device, their
    weights the one checkpoint copy's tensors (one set of weights, streamed once)."""
    options, loaded, model = conversion.options, conversion.loaded, conversion.loaded.model
    spec = export_stage.generation_spec(model, options.max_batch, options.max_context, options.cache_layout, seq, options.kv_cache_dtype,
                                        options.sliding_window_cache)
    checkpoint_model, state = _streamed_weights(conversion)
    modules = export_stage.entry_point_modules(model, spec)
    # A plan of a model built on the CPU exports with its CPU weights, as a forward plan does.
    on_meta = state is not None or (conversion.plan_only and export_stage.weights_on_meta(model))
    sizes = {} if spec.static_prompt else {"seq": list(spec.prefill_buckets)}  # a left-padded prefill's seq is static (one bucket)
    if spec.max_batch > 1:  # one cache slot: prefill's batch is static (no batch dim to bucket)
        sizes["batch"] = list(batches)
    entry_points = {}
    for name, (args, dynamic_shapes) in export_stage.example_arguments(spec, "meta" if on_meta else "cpu").items():
        source = export_stage.LoadedSource(modules[name], args, dynamic_shapes, None, loaded.info, checkpoint=state)
        source = export_stage.on_meta_device(source) if conversion.plan_only else source
        entry_points[name] = EntryPointSpec(source, sizes if name == "prefill" else None, DECODE_KERNEL_REASON if name == "decode" else None)
    # Draws the next tokens from prefill's logits (a prefill batch's rows) or decode's (max batch).
    sample_rows = sorted({*batches, spec.max_batch})
    entry_points["sample"] = _sample_entry_point(spec.vocab, sample_rows, loaded.info)
    cache = f"{f'int8 + {spec.scale_dtype} scales' if spec.quantized else spec.dtype}"
    description = (f"entry points prefill (batch {list(batches)} x seq {list(spec.prefill_buckets)}), decode (batch {spec.max_batch}) and "
                   f"sample (rows {sample_rows}); cache {spec.layout} {list(spec.cache_shape)} {_describe_window_cache(spec)}{cache}"
                   f"{spec.describe_states()}")
    return ProgramSpec(entry_points, lambda lowered: lower_stage.GenerationProgram(spec, lowered, batches), True, description,
                       GenerationSources(spec, model, modules, checkpoint_model),
                       (checkpoint_model,) if checkpoint_model is not None else ())


def _sample_entry_point(vocab: int, rows: list[int], info: export_stage.SourceInfo) -> EntryPointSpec:
    """The sample entry point over `vocab` tokens at `rows` buckets: the process's one program for that
    vocabulary (export_stage.sample_program), reading none of the model's weights."""
    source = export_stage.LoadedSource(export_stage.sample_program(vocab), None, None, None, info)
    return EntryPointSpec(source, {"rows": rows}, SAMPLE_KERNEL_REASON, reads_weights=False, precision="f32")


def _streamed_weights(conversion: Conversion) -> tuple[torch.nn.Module | None, export_stage.Checkpoint | None]:
    """With a checkpoint (and weights), the copy of the model holding the checkpoint's memory-mapped
    tensors (generate()'s reference) and those tensors by its state names, which every entry point
    module over the model takes as its weights (one copy, streamed once); else (None, None)."""
    loaded = conversion.loaded
    if loaded.checkpoint is None or conversion.plan_only:
        return None, None
    checkpoint_model = export_stage.with_checkpoint_weights(loaded.model, loaded.checkpoint)
    state = export_stage.Checkpoint(
        {**dict(checkpoint_model.named_parameters(remove_duplicate=False)), **dict(checkpoint_model.named_buffers(remove_duplicate=False))},
        loaded.checkpoint.description, loaded.checkpoint.name)
    return checkpoint_model, state


def _check_paged(conversion: Conversion) -> None:
    """Refuses, in one line, what the paged step does not take yet."""
    options, loaded = conversion.options, conversion.loaded
    if export_stage.is_encoder_decoder(loaded.model):
        raise TpuExportError("--kv-cache paged does not support an encoder-decoder yet; use --kv-cache static for it")
    if conversion.slices:  # before any export: the pages' layout on each slice's mesh
        kv_heads = cached_shapes(loaded.model)[0]
        for target in conversion.slices:
            _check_paged_mesh(kv_heads, options.sharding.preset, dict(compile_stage.resolve_mesh(options.sharding, target)))


def _paged_input_rules(spec: export_stage.PagedSpec, preset: str, mesh: dict[str, int], inputs: list[str]) -> tuple:
    """The pages' lanes (per kv head, its keys then its values) on the model axis with tensor-parallel, so
    each device holds its heads' keys and values of every page; whole otherwise (and for an entry point
    without the cache among its `inputs`).

    A mesh the pages cannot take was refused before any export (`_check_paged`).
    """
    if preset != "tensor-parallel" or mesh.get("model", 1) == 1:
        return ()
    lanes = (None,) * (len(spec.cache_shape) - 1) + ("model",)
    return tuple((name, lanes) for name in spec.cache_inputs if name in inputs)


def _check_paged_mesh(kv_heads: int, preset: str, mesh: dict[str, int]) -> None:
    """Refuses a data axis or a data-parallel preset (every row's pages are in one pool, so no axis
    splits the rows), and kv heads that do not split evenly over the model axis."""
    split = {axis: size for axis, size in mesh.items() if size > 1}
    if "data" in split or preset in ("data-parallel", "fsdp"):
        raise TpuExportError(f"--kv-cache paged does not split rows over a data axis (every row's pages are in one pool): --sharding "
                             f"{preset} with mesh {','.join(f'{axis}={size}' for axis, size in mesh.items())}; use --sharding tensor-parallel "
                             "with --mesh model=N (other axes hold replicas), or --kv-cache static")
    if preset == "tensor-parallel" and "model" in split and kv_heads % split["model"]:
        raise TpuExportError(f"--kv-cache paged with tensor-parallel: the model's {kv_heads} kv heads do not split over model="
                             f"{split['model']}; use a slice whose device count divides {kv_heads}, or --kv-cache static")


def _paged_spec(conversion: Conversion, requested: dict[str, list[int]]) -> ProgramSpec:
    """The step over pages and the sample entry point over its rows' logits (export/paged.py)."""
    options, loaded, model = conversion.options, conversion.loaded, conversion.loaded.model
    unknown = sorted(set(requested) - {"tokens", "rows"})
    if unknown:
        raise TpuExportError(f"--bucket {unknown[0]} is not a dim of the paged step; its dims are tokens (token budget) and rows")
    spec = export_stage.paged_spec(model, options.max_batch, options.max_context, options.page_size, options.num_pages,
                                   tuple(requested["tokens"]) if "tokens" in requested else None,
                                   tuple(requested["rows"]) if "rows" in requested else None, options.kv_cache_dtype)
    checkpoint_model, state = _streamed_weights(conversion)
    module = export_stage.Step(model.eval(), spec)
    # As the static entry points: streamed from a checkpoint, exported on the meta device (a plan of a model
    # built on the CPU exports with its CPU weights).
    on_meta = state is not None or (conversion.plan_only and export_stage.weights_on_meta(model))
    args, shapes = export_stage.step_example_arguments(spec, "meta" if on_meta else "cpu")
    source = export_stage.LoadedSource(module, args, shapes, None, loaded.info, checkpoint=state)
    source = export_stage.on_meta_device(source) if conversion.plan_only else source
    sizes = {"tokens": list(spec.token_buckets), "rows": list(spec.row_buckets)}
    entry_points = {"step": EntryPointSpec(source, sizes, PAGED_KERNEL_REASON),
                    "sample": _sample_entry_point(spec.vocab, list(spec.row_buckets), loaded.info)}
    description = (f"entry points step (tokens {list(spec.token_buckets)} x rows {list(spec.row_buckets)}) and sample (rows "
                   f"{list(spec.row_buckets)}); paged cache {list(spec.cache_shape)} "
                   f"{f'int8 + {spec.dtype} scales' if spec.quantized else spec.dtype} ({spec.num_pages} pages of {spec.page_size}, "
                   f"{spec.cache_bytes / 2**20:.1f} MiB)")
    return ProgramSpec(entry_points, lambda lowered: lower_stage.PagedGenerationProgram(spec, lowered), True, description,
                       GenerationSources(spec, model, {"step": module}, checkpoint_model),
                       (checkpoint_model,) if checkpoint_model is not None else ())


def _seq2seq_spec(conversion: Conversion, seq: tuple[int, ...] | None, batches: tuple[int, ...]) -> ProgramSpec:
    """Encode and decode over one encoder-decoder. Unscanned: encode would scan the encoder's layers
    (their weights stacked) while decode, which does not run the encoder, keeps them apart, and the
    two must take one set of weights. Sizes: --max-batch, --max-context (decoder positions), --bucket
    seq= (source lengths; the longest is the cross cache's positions; not for audio sources, whose
    length is the encoder's), --bucket batch= (encode batches)."""
    options, loaded, model = conversion.options, conversion.loaded, conversion.loaded.model
    spec = export_stage.seq2seq_spec(model, options.max_batch, options.max_context, seq)
    modules = export_stage.seq2seq_entry_point_modules(model, spec)
    # Audio features have no seq dim (their frames are static); batch is a dim unless max batch is 1.
    sizes = {"batch": list(batches)} if spec.max_batch > 1 else {}
    if spec.source != "features":
        sizes["seq"] = list(spec.source_buckets)
    entry_points = {name: EntryPointSpec(export_stage.LoadedSource(modules[name], args, shapes, None, loaded.info),
                                         sizes if name == "encode" else None, ENCODER_DECODER_KERNEL_REASON)
                    for name, (args, shapes) in export_stage.seq2seq_example_arguments(spec).items()}
    sources = f"{spec.features[0]} x {spec.features[1]} features" if spec.source == "features" else f"source {list(spec.source_buckets)}"
    description = (f"entry points encode (batch {list(batches)} x {sources}) and decode (batch {spec.max_batch}); "
                   f"caches {list(spec.cache_shape)} + cross {list(spec.cross_shape)} {spec.dtype}")
    return ProgramSpec(entry_points, lambda lowered: lower_stage.Seq2SeqProgram(spec, lowered, batches), False, description,
                       GenerationSources(spec, model, modules, None))


def _verify_generation(conversion: Conversion):
    """The generation report of the program against its reference (module docstring)."""
    program, options, sources = conversion.program, conversion.options, conversion.spec.state
    tolerances = verification_tolerances(program.weights_program, options, conversion.quantized is not None)
    fill_bytes = conversion.run_memory.fill_bytes  # the memory budget's bound on a fill case's CPU temporaries
    if isinstance(program, lower_stage.Seq2SeqProgram):
        return verify_stage.verify_seq2seq(program, sources.model, tolerances, options.new_tokens)
    paged = isinstance(program, lower_stage.PagedGenerationProgram)
    if conversion.quantized:  # int8: against the PT2E entry points, as forward int8 programs are
        references = {name: result.captured.reference for name, result in conversion.quantized.items()}
        if paged:
            first_inputs = conversion.quantized["step"].evaluation_samples[0]
            return verify_stage.verify_quantized_paged_generation(program, sources.model, references["step"], tolerances, options.new_tokens,
                                                                  first_inputs)
        return verify_stage.verify_quantized_generation(program, sources.model, references, tolerances, options.new_tokens, fill_bytes)
    float_model = sources.model if sources.checkpoint_model is None else sources.checkpoint_model
    # A weight-only program is compared with generate() on the model with those weights dequantized;
    # its distance from the float model's generate() is measured too (an int8 cache's as well).
    weight_only = conversion.weight_only
    float_reference = None
    if weight_only or program.spec.quantized:
        float_reference = (verify_stage.paged_eager_references(program, float_model, options.new_tokens) if paged
                           else verify_stage.eager_references(program, float_model, options.new_tokens, fill_bytes))
    if sources.checkpoint_model is None:
        with _dequantized_weights(sources.modules["step" if paged else "decode"], program.weights_program, weight_only):
            return _generation_report(conversion, sources.model, tolerances, float_reference)
    eager_model = sources.checkpoint_model if weight_only is None else _dequantized_checkpoint_model(conversion)
    return _generation_report(conversion, eager_model, tolerances, float_reference)


def _generation_report(conversion: Conversion, model: torch.nn.Module, tolerances, float_reference):
    """The program's generation against generate() of `model` (the float model, the checkpoint's, or
    one computing with the weight-only weights rounded): over pages, over an int8 cache (against the
    eager int8-cache entry points over `model`), or over the static cache."""
    program, options, sources = conversion.program, conversion.options, conversion.spec.state
    fill_bytes = conversion.run_memory.fill_bytes
    if isinstance(program, lower_stage.PagedGenerationProgram):
        eager_step = None
        if program.spec.quantized:  # against the eager int8-cache step over `model`
            eager_step = sources.modules["step"] if model is sources.model else export_stage.Step(model, program.spec)
        return verify_stage.verify_paged_generation(program, model, tolerances, options.new_tokens, float_reference, eager_step=eager_step)
    if program.spec.quantized:
        modules = sources.modules if model is sources.model else export_stage.entry_point_modules(model, program.spec)
        return verify_stage.verify_int8_kv_generation(program, modules, tolerances, float_reference, options.new_tokens, fill_bytes)
    return verify_stage.verify_generation(program, model, tolerances, options.new_tokens, float_reference, fill_bytes=fill_bytes)


def _reference_prompt(conversion: Conversion) -> torch.Tensor:
    """A seeded prompt of 64 tokens (at most max context), over which a failed verification runs the
    model's forward looking for tied top-k selections (a mixture-of-experts router's)."""
    spec = conversion.program.spec
    return torch.randint(0, spec.vocab, (1, min(64, spec.max_context)), generator=torch.Generator().manual_seed(0))


def _verify_sampling(conversion: Conversion, report) -> tuple:
    """The sample entry point against the NumPy reference and Hugging Face's distributions
    (verify/sampling.py); its result extends the manifest's verification section.

    Raises:
      VerificationError: a check failed (its report written next to the artifact).
    """
    program = conversion.program
    if "sample" not in program.entry_points:  # an encoder-decoder samples on the host, with the reference itself
        return ()
    with conversion.clock.stage("verify sampling", lambda: sampling.describe()):
        sampling = verify_stage.verify_sampling(program.entry_points["sample"].run, program.spec.vocab)
    if not sampling.passed:
        failed = {**report.to_json(), "sampling": sampling.to_json()}
        raise VerificationError(report, write_failed_report(conversion.options.out, failed), sampling.failure_summary())
    return (lambda staging: {"verification": {"sampling": sampling.to_json()}},)


def _verify_slices(conversion: Conversion, report) -> list:
    """Per distinct set of entry-point plans (one per slice target; equal sizes share one), a verified
    case's fill and decode steps partitioned by them on as many CPU devices (verify/sharded_generation.py).

    Raises:
      VerificationError: a plan's run does not match (its report written next to the artifact).
    """
    plans, program = conversion.plans, conversion.program
    verify_sharded = (verify_stage.verify_sharded_paged if isinstance(program, lower_stage.PagedGenerationProgram)
                      else verify_stage.verify_sharded_generation)
    grouped: dict[tuple, list[str]] = {}
    for target in next(iter(plans.values()), {}):
        grouped.setdefault(tuple(plans[name][target] for name in plans), []).append(target)
    results = []
    for entry_plans, targets in grouped.items():
        entry_plans = dict(zip(plans, entry_plans))
        with conversion.clock.stage(f"verify sharded {entry_plans[program.fill_entry_point].mesh_text}", lambda: results[-1].describe()):
            results.append(verify_sharded(program, entry_plans, targets, report))
        if not results[-1].passed:
            failed = {**report.to_json(), "sharded": [result.to_json() for result in results]}
            raise VerificationError(report, write_failed_report(conversion.options.out, failed), results[-1].failure_summary())
    return results


def _dequantized_weights(module: torch.nn.Module, lowered: lower_stage.LoweredProgram, scheme):
    """While open, eager PyTorch computes with `module`'s weight-only weights rounded and dequantized
    (quantize/weight_only.py); a no-op without a scheme."""
    if scheme is None:
        return contextlib.nullcontext()
    from tpuexport.quantize.weight_only import DequantizedReference, DequantizedWeights

    return DequantizedWeights(DequantizedReference(module, lowered.quantized_state_axes, scheme).weights, scheme)


def _dequantized_checkpoint_model(conversion: Conversion) -> torch.nn.Module:
    """The eager reference of a weight-only generation program streamed from a checkpoint: a copy of
    the model whose quantized weights are the checkpoint's rounded and dequantized (from its float
    tensors, not from the artifact's integers) once, written to a scratch file and memory-mapped,
    and whose other weights are the checkpoint model's (the checkpoint's memory maps).

    Rounding at every use (DequantizedWeights) would round every weight again at each generate()
    step: for Llama-3.2-1B, minutes per step on two cores. The file is written one weight at a time
    and its pages are file-backed, so the process owns no rounded copy of the model.
    """
    import jax

    from tpuexport.safetensors_files import numpy_dtype
    from tpuexport.quantize.weight_only import fake_quantized, scheme_for

    sources, scheme, lowered = conversion.spec.state, conversion.weight_only, conversion.program.weights_program
    # The entry points hold the causal LM as `model` (export/generation.py), so their state names carry that prefix.
    axes = {part.removeprefix("model."): axis for part, axis in lowered.quantized_state_axes.items()}
    model = sources.checkpoint_model
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # one name per tensor (tied once)
    names = [name for name in state if name in axes]
    path = conversion.scratch / "dequantized.safetensors"
    with conversion.clock.stage("dequantize", lambda: f"{len(names)} weight(s) rounded and dequantized once for generate(), "
                                                      f"{written / 2**30:.2f} GiB memory-mapped"):
        specs = [jax.ShapeDtypeStruct(tuple(state[name].shape), numpy_dtype(str(state[name].dtype).removeprefix("torch."))) for name in names]
        written = artifact_stage.write_weights(path, names, specs, lambda name: [fake_quantized(state[name], scheme_for(scheme, state[name].shape, axes[name]), axes[name])])
        dequantized = export_stage.open_checkpoint(path)
        tensors = {name: dequantized[name] if name in axes else tensor for name, tensor in state.items()}
        reference = export_stage.with_checkpoint_weights(sources.model, export_stage.Checkpoint(tensors, "the dequantized weights"))
    return reference


def _logits_sqnr(divergence: dict | None) -> list[dict]:
    """The logits' SQNR against the float model's generate() that verification measured
    (report.float_divergence), as a quantization section's outputs ([] if not measured)."""
    return [{"name": "logits", "sqnr_db": divergence["sqnr_db"]}] if divergence else []


def _int8_report(conversion: Conversion, report):
    """The writer of a PT2E int8 generation artifact's quantization report (SQNR per entry point and of
    the verified logits against the float model, the integer share of each entry point's first TPU
    executable's matmul FLOPs)."""
    from tpuexport.verify import quantization_report

    def write(staging: pathlib.Path) -> dict:
        with conversion.clock.stage("quantization report", lambda: quantization_report.describe_report(content)):
            matmuls = {name: quantization_report.CompiledMatmuls(result.results[0].target.name, result.results[0].bucket.name,
                                                                 result.results[0].matmul_flops)
                       for name, result in conversion.compiled().items()}
            content = quantization_report.generation_report(conversion.quantized, conversion.program, matmuls, report.float_comparison)
        return quantization_report.report_writer(content)(staging)

    return write


def decode_step_figures(result, spec) -> dict:
    """What one decode step must read per device (its arguments: weights + the whole cache, the
    live cache at max batch x max context) next to XLA's bytes accessed, and the largest batch
    that fits the device, estimated linearly from the compiled max batch (cache and temporaries
    grow with the batch, weights do not)."""
    memory = result.memory
    must_read = memory["argument_bytes"]
    cache = _cache_bytes_per_device(result, spec)
    per_slot = (cache + memory["temp_bytes"]) / spec.max_batch
    headroom = result.target.hbm_bytes_per_device - memory["total_bytes"]
    accessed = result.cost.get("bytes_accessed") or 0.0
    return {
        "must_read_bytes": must_read,
        # The arguments less the cache: the weights (and the step's few token and position ids).
        "weight_bytes": must_read - cache,
        "cache_bytes": cache,
        "temp_bytes": memory["temp_bytes"],
        "xla_bytes_accessed": accessed if accessed > 0 else "unknown",
        "bytes_accessed_over_must_read": round(accessed / must_read, 4) if accessed > 0 and must_read else "unknown",
        "largest_batch_estimate": max(0, int(spec.max_batch + headroom // per_slot)) if per_slot > 0 else "unknown",
    }


def paged_step_figures(result, spec, sized=None, mean_length: int = 512) -> dict:
    """What a paged step's executable leaves for pages on its chip (per device of a slice, whose pages hold
    its kv heads' share): the weights (its arguments less the cache) and its temporaries stay, the rest
    of HBM holds pages; with the sequences of `mean_length` positions those pages hold (each row's last
    page partly filled). The executable's own pages (`num_pages`) and, when they were sized to the
    target's HBM (`sized`: tasks/page_count.SizedPages), how (`num_pages_sized`); then what fits is
    that count, which compiled and fitted (the estimate holds the temporaries fixed, and XLA's grow
    with the count past some size)."""
    memory = result.memory
    num_pages = result.bucket.as_dict().get(PAGES_DIM, spec.num_pages)
    cache = _cache_bytes_per_device(result, dataclasses.replace(spec, num_pages=num_pages))
    page_bytes = cache // num_pages
    weights = memory["argument_bytes"] - cache
    pages = sized.num_pages if sized else max(0, (result.target.hbm_bytes_per_device - weights - memory["temp_bytes"]) // page_bytes)
    return {"num_pages": num_pages, "num_pages_sized": sized.to_json() if sized else None, "cache_bytes": cache, "page_bytes": page_bytes,
            "weight_bytes": weights, "temp_bytes": memory["temp_bytes"], "pages_fit": int(pages), "tokens_fit": int(pages * spec.page_size),
            "mean_length": mean_length, "sequences_fit_at_mean_length": int(pages // -(-mean_length // spec.page_size))}


def _cache_bytes_per_device(result, spec) -> int:
    """The KV cache's bytes on one device: whole on a chip, divided by the mesh axes that split it on a slice."""
    if result.plan is None:
        return spec.cache_bytes
    mesh, inputs = dict(result.plan.mesh), dict(result.plan.inputs)
    split = 1
    for entry in inputs.get(spec.cache_inputs[0], ()):
        for axis in (entry if isinstance(entry, (tuple, list)) else (entry,)):
            if axis is not None:
                split *= mesh[axis]
    return spec.cache_bytes // split


def _describe_window_cache(spec) -> str:
    """The window-bounded cache in the export stage's line ('' for a max-context cache)."""
    if spec.window_layers:
        return (f"+ window cache {list(spec.window_cache_shape)} (rings of sliding window {spec.cache_window}, layers "
                f"{','.join(map(str, spec.window_layers))}) ")
    return f"(a ring: sliding window {spec.cache_window}) " if spec.cache_window else ""


def describe_generation(report, fill: str = "prefill", fix: str = "") -> str:
    """The verify stage's line; logits far from the float model's (a weight-only program's, an int8 KV
    cache's) end it with the warning its quantization section records, advising `fix`."""
    worst = report.worst_errors()
    reference = ("the PT2E entry points" if isinstance(report, verify_stage.QuantizedGenerationReport)
                 else "the eager int8-KV entry points" if report.against == verify_stage.INT8_KV_AGAINST else "generate()")
    buckets = f"{len(report.cases)} step bucket(s), prompts in chunks beside decode rows" if fill == "step" else f"{len(report.cases)} {fill} bucket(s) + decode"
    described = (f"{buckets}, {report.tokens_compared()} tokens compared with {reference}, "
                 f"{'passed' if report.passed else 'FAILED'} ({report.ties()} tie(s)); worst logits relative RMS error {worst['tpu']:.1e} "
                 f"as the TPU computes, {worst['cpu']:.1e} in f32")
    if isinstance(report, verify_stage.QuantizedGenerationReport) or report.float_divergence() is None:
        return described
    divergence = report.float_divergence()
    first = divergence["first"]
    sqnr = "identical" if divergence["sqnr_db"] is None else f"{divergence['sqnr_db']:.1f} dB"
    from tpuexport.verify import quantization_report

    warnings = quantization_report.low_sqnr_warnings(_logits_sqnr(divergence), fix) if fix else []
    return (described + "; vs the float model: " + ("same greedy tokens" if first is None else f"first differs at step {first['step']}")
            + f", logits SQNR {sqnr}" + "".join(f"; WARNING: {warning}" for warning in warnings))


def describe_lowered(program) -> str:
    """The lower stage's line of a generation program."""
    shared = program.weights_program
    return f"{len(shared.weight_names)} weight arrays shared by {', '.join(program.entry_points)}, precision {describe_precision(shared)}"
