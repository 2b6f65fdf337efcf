"""The `tpuexport` command: parses, calls the Python API, prints. Exit codes: 0 ok,
1 verification failed, 2 bad input (one line on stderr, no traceback, nothing written)."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import pathlib
import sys
import warnings

import click
from rich.console import Console
from rich.table import Table

from tpuexport import memory
from tpuexport.errors import EXIT_BAD_INPUT, EXIT_VERIFICATION_FAILED, TpuExportError, VerificationError
from tpuexport.defaults import DEFAULT_BUDGET_FLOPS

stderr = Console(stderr=True, highlight=False)


def handles_errors(command):
    """Maps tpuexport's errors to one line on stderr and the documented exit code."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        # torch and jax warn about their own internals; a user of the command cannot act on it.
        warnings.filterwarnings("ignore")
        try:
            return command(*args, **kwargs)
        except TpuExportError as error:
            stderr.print(f"[bold red]error:[/] {error}", soft_wrap=True)
            sys.exit(EXIT_BAD_INPUT)
        except VerificationError as error:
            stderr.print(f"[bold red]verification failed:[/] {str(error).removeprefix('verification failed: ')}", soft_wrap=True)
            sys.exit(EXIT_VERIFICATION_FAILED)

    return wrapper


# Commands whose work is the host CPU's (converting, verifying, reading manifests): their process starts
# JAX's CPU backend only, whatever JAX_PLATFORMS says, so a conversion on a TPU VM leaves the chips to
# the server. serve and generate run on the devices JAX sees (tpuexport/devices.py).
HOST_CPU_COMMANDS = ("convert", "plan", "verify", "inspect", "targets", "deployment")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tpuexport")
@click.pass_context
def main(context):
    """Convert PyTorch models into verified TPU artifacts, on a CPU-only machine."""
    if context.invoked_subcommand in HOST_CPU_COMMANDS:
        import jax

        jax.config.update("jax_platforms", "cpu")


# Options `convert` and `plan` share: the model, what to compile it for, and where to write.
SOURCE_AND_TARGET_OPTIONS = (
    click.option("--target", "targets", multiple=True, default=("v5e",), show_default=True,
                 help="TPU target (repeat for several): a chip (v4, v5e, v5p, v6e, 7x) or a slice (v5e-8, v5p-8, v6e-8, 7x-8, ...); "
                      "cpu for XLA:CPU executables of this host (tpuexport serve runs them); cpu-N, a slice's CPU twin "
                      "(same plan, N forced CPU devices)."),
    click.option("-o", "--out", type=click.Path(path_type=pathlib.Path), help="Artifact directory [default: SOURCE stem + .tpu]."),
    click.option("--bucket", "buckets", multiple=True, metavar="DIM=S1,S2,...",
                 help="Sizes to compile for a dim (repeat per dim; cartesian product). Default: the example shapes."),
    click.option("--precision", type=click.Choice(["auto", "f32", "bf16", "bf16-mixed"]), default="auto", show_default=True,
                 help="auto: the model's own dtypes tensor by tensor; f32: weights and inputs in f32; bf16: weights and every op in "
                      "bfloat16 (state the model keeps in f32 stays f32); bf16-mixed: matmuls/convolutions in bfloat16, softmax, "
                      "norms and reductions in f32."),
    click.option("--matmul-precision", type=click.Choice(["default", "high", "highest"]), default="default", show_default=True,
                 help="TPU arithmetic of every dot/convolution: one bf16 pass, bf16x3, or f32 accuracy (six passes)."),
    click.option("--kernels", type=click.Choice(["auto", "none"]), default="auto", show_default=True,
                 help="TPU kernels per bucket: auto uses Pallas flash attention where it reads fewer bytes (manifest: kernels or "
                      "why not, per executable); none compiles the kernel-free program everywhere."),
    click.option("--task", default="auto", show_default=True, metavar="TASK",
                 help="Task of a Hugging Face directory / hf:ORG/NAME source, as optimum names it (text-classification, "
                      "text-generation, image-classification, automatic-speech-recognition, ...); auto: from config.json's architectures."),
    click.option("--input", "inputs", multiple=True, metavar="NAME:D0,D1,...[:DTYPE]", help="Input of a pickled model (repeat, in order)."),
    click.option("--dim", "dims", multiple=True, metavar="NAME=MIN:MAX",
                 help="A symbolic dim used by --input, or a Hugging Face source's dim range (batch, sequence, ...; MIN=MAX: static)."),
    click.option("--trust-pickle", is_flag=True, help="Allow unpickling a .pt/.pth module (pickles run code when loaded)."),
    click.option("--force", is_flag=True, help="Replace an existing artifact at --out."),
    click.option("--mesh", metavar="AXIS=SIZE,...",
                 help="Device mesh of slice targets, e.g. data=2,model=4 (sizes multiply to the slice's devices)."),
    click.option("--sharding", type=click.Choice(["replicated", "data-parallel", "tensor-parallel", "fsdp"]),
                 help="Sharding preset for slice targets [default: replicated]."),
    click.option("--shard", "shard_rules", multiple=True, metavar="REGEX=SPEC",
                 help="Lay out weights whose state_dict name matches REGEX, e.g. 'q_proj=model,None' (repeat; later rules win)."),
    click.option("--shard-input", "shard_inputs", multiple=True, metavar="NAME=SPEC",
                 help="Lay out one input, e.g. tokens=data,None (repeat)."),
    click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout."),
)


def source_and_target_options(command):
    """Adds SOURCE_AND_TARGET_OPTIONS to a command (in their order in --help)."""
    for option in reversed(SOURCE_AND_TARGET_OPTIONS):
        command = option(command)
    return command


def _describe_window_cache(generation: dict) -> str:
    """A text-generation manifest's window-bounded cache, for `inspect` ('' for a max-context cache)."""
    if "window_layers" in generation:
        return (f"; sliding layers {generation['window_layers']}: rings of {generation['cache_window']} positions "
                f"{generation['window_cache_shape']} x2")
    return f"; a ring of {generation['cache_window']} positions (the sliding window)" if generation.get("cache_window") else ""


compile_env_option = click.option(
    "--compile-env", "compile_envs", multiple=True, metavar="PYTHON",
    help="Also compile every target under this Python (a serving image's jax/jaxlib/libtpu); the artifact carries "
         "executables per version set and the runtime loads its host's. Repeatable.")


@main.command()
@click.argument("source")
@source_and_target_options
@click.option("--atol", type=float, help="Verification absolute tolerance [default per numeric setting].")
@click.option("--rtol", type=float, help="Verification tolerance relative to each element [default per numeric setting].")
@click.option("--scale-tol", type=float, help="Verification tolerance relative to each output's RMS [default per numeric setting].")
@click.option("--verify-budget", "verify_budget", type=float, default=DEFAULT_BUDGET_FLOPS / 1e9, show_default=True, metavar="GFLOP",
              help="Matmul GFLOP the optional verification sizes (max, mid) may add.")
@click.option("--memory-budget", "memory_budget", metavar="GB",
              help="What the converting process may hold, in GB: verification's optional runs (max/mid sizes, the padded "
                   "bucket, generation fills) are shrunk or skipped to stay within it, and weights read into memory that "
                   "alone exceed it are refused before they are read. [default: what the process holds at the start + "
                   f"{memory.DEFAULT_BUDGET_FRACTION:g} of the machine's MemAvailable]")
@click.option("--verify-size", "verify_sizes", multiple=True, metavar="DIM=S,DIM=S",
              help="Sizes that must also be verified (repeat for several; unnamed dims at their example size).")
@click.option("--scan/--no-scan", default=True, show_default=True,
              help="Lower runs of identical blocks (a model's layers) as one scan, their weights stacked.")
@click.option("--saved-model/--no-saved-model", default=True, show_default=True,
              help="Write a TF Serving SavedModel under tf_serving/ and check it in TensorFlow.")
@click.option("--name", "model_name", help="TF Serving model name [default: SOURCE stem].")
@click.option("--version", "model_version", type=int, default=1, show_default=True, help="TF Serving model version.")
@click.option("--quantize", type=click.Choice(["int8", "int8-dynamic", "int8-weight-only", "int4-weight-only"]),
              help="int8 (PT2E): static (calibrated activations) or dynamic (run-time activation scales); weight-only int8 "
                   "(per output channel) or int4 (grouped), also with --checkpoint.")
@click.option("--group-size", type=int, default=128, show_default=True,
              help="int4-weight-only: weights per bfloat16 scale along the contraction dim.")
@click.option("--keep-float", metavar="REGEX", help="Weight-only: keep weights whose state_dict name matches REGEX float (e.g. lm_head).")
@click.option("--calibration", "calibration_file", type=click.Path(path_type=pathlib.Path),
              help="Calibration samples for --quantize int8: .npz/.safetensors, one array per input name, samples on axis 0; "
                   "with --task text-generation, prompts: 'tokens' [N, seq] and optional 'lengths' [N].")
@click.option("--random-calibration", is_flag=True, help="Calibrate --quantize int8 on random inputs (not real data; warned).")
@click.option("--weights/--no-weights", "weights", default=True, show_default=True,
              help="--no-weights: a plan, as `tpuexport plan` (compiled from the weights' shapes; not verified, no SavedModel).")
@click.option("--checkpoint", type=click.Path(path_type=pathlib.Path),
              help="Stream the weights from this checkpoint (.safetensors, a sharded directory with its index, or a .pt state_dict); "
                   "the factory's model is built with its parameters on the meta device (with --task text-generation too: "
                   "the factory returns the causal LM).")
@click.option("--max-context", type=int, help="text-generation: positions per KV cache slot (prompt + generated tokens).")
@click.option("--max-batch", type=int, default=1, show_default=True, help="text-generation: KV cache slots, decode's batch.")
@click.option("--cache-layout", type=click.Choice(["layer_batch_head_pos", "layer_batch_pos_head"]), default="layer_batch_head_pos",
              show_default=True, help="text-generation: the KV cache's axes.")
@click.option("--kv-cache-dtype", default="model", show_default=True,
              help="text-generation: 'model' (the cache in the model's dtype) or 'int8' (int8 keys and values with a scale "
                   "per layer, slot, kv-head and position, in the model's dtype).")
@click.option("--sliding-window-cache", default="bounded", show_default=True,
              help="text-generation: 'bounded' keeps W positions per slot (a ring) when every layer attends within one "
                   "sliding window W < max context (Mistral, Mixtral, Phi-3); 'full' keeps max-context positions.")
@click.option("--kv-cache", default="static", show_default=True,
              help="text-generation: 'static' (prefill and decode over max batch x max context) or 'paged' (one step entry "
                   "point over pages taken as rows grow; --bucket tokens=...,rows=...).")
@click.option("--page-size", type=int, help="--kv-cache paged: positions per page [default: 16].")
@click.option("--num-pages", type=int, help="--kv-cache paged: pages in the cache, for every target [default: per TPU target, what its HBM per "
                   "device holds beside the largest step bucket's weights and temporaries (found by compiling it); CPU targets "
                   "and verification: max batch rows of max context].")
@click.option("--verify-new-tokens", type=int, default=8, show_default=True,
              help="text-generation: tokens each verification prompt generates, compared with generate().")
@compile_env_option
@handles_errors
def convert(source, targets, out, buckets, precision, matmul_precision, kernels, task, inputs, dims, trust_pickle, force, mesh, sharding, shard_rules,
            shard_inputs, as_json, atol, rtol, scale_tol, verify_budget, memory_budget, verify_sizes, scan, saved_model, model_name, model_version, quantize,
            group_size, keep_float, calibration_file, random_calibration, weights, checkpoint, max_context, max_batch, cache_layout,
            kv_cache_dtype, sliding_window_cache, kv_cache, page_size, num_pages, verify_new_tokens, compile_envs):
    """Convert SOURCE (a Hugging Face model directory or hf:ORG/NAME with --task, model.pt2, file.py:factory, or model.pt with
    --trust-pickle) into an artifact."""
    overrides = {name: value for name, value in (("atol", atol), ("rtol", rtol), ("scale_tol", scale_tol)) if value is not None}
    if verify_budget < 0:
        raise TpuExportError(f"--verify-budget {verify_budget:g} is negative; give GFLOP >= 0 (0 runs only the sizes every conversion runs)")
    budget = memory.memory_budget(memory_budget)  # the default (None) is read now, before the source is loaded
    _convert_source(
        source, targets, out, buckets, inputs, dims, trust_pickle, (mesh, sharding, shard_rules, shard_inputs), as_json, task=task,
        precision=precision, matmul_precision=matmul_precision, kernels=kernels, tolerance_overrides=overrides,
        verify_budget_flops=verify_budget * 1e9,
        verify_sizes=tuple(parse_sizes(text, "--verify-size") for text in verify_sizes), overwrite=force,
        scan=scan, saved_model=saved_model and weights, model_name=model_name, model_version=model_version, quantize=quantize,
        group_size=group_size, keep_float=keep_float, calibration_file=calibration_file, random_calibration=random_calibration,
        weights=weights, checkpoint=checkpoint, max_context=max_context, max_batch=max_batch, cache_layout=cache_layout,
        kv_cache_dtype=kv_cache_dtype, sliding_window_cache=sliding_window_cache, kv_cache=kv_cache, page_size=page_size,
        num_pages=num_pages, new_tokens=verify_new_tokens, compile_envs=compile_envs, memory_budget=budget,
    )


@main.command()
@click.argument("source")
@source_and_target_options
@compile_env_option
@handles_errors
def plan(source, targets, out, buckets, precision, matmul_precision, kernels, task, inputs, dims, trust_pickle, force, mesh, sharding, shard_rules,
         shard_inputs, as_json, compile_envs):
    """Plan SOURCE without weights (e.g. a model built on the meta device): compile for every target and bucket with the
    sharding plan and report per-chip HBM; no verification, no weights in the artifact."""
    _convert_source(source, targets, out, buckets, inputs, dims, trust_pickle, (mesh, sharding, shard_rules, shard_inputs), as_json, task=task,
                    precision=precision, matmul_precision=matmul_precision, kernels=kernels, overwrite=force, saved_model=False,
                    weights=False, compile_envs=compile_envs)


def _convert_source(source: str, targets, out, buckets, inputs, dims, trust_pickle: bool, sharding_options: tuple, as_json: bool,
                    checkpoint: pathlib.Path | None = None, task: str = "auto", **options) -> None:
    """Loads SOURCE, runs the conversion (or plan) and prints the outcome.

    Args:
      source: the SOURCE argument.
      targets, out, buckets, inputs, dims, trust_pickle: the shared options as click gives them.
      sharding_options: (--mesh, --sharding, --shard rules, --shard-input rules).
      as_json: print the summary as JSON on stdout.
      checkpoint: --checkpoint; task: --task (Hugging Face sources).
      **options: the remaining ConversionOptions fields (model_name None for the source's stem).
    Raises:
      TpuExportError: bad input; VerificationError: the conversion did not verify.
    """
    from tpuexport import compile as compile_stage
    from tpuexport import export as export_stage
    from tpuexport.pipeline import ConversionOptions, run_conversion

    dim_specs = [export_stage.parse_dim(text) for text in dims]
    by_name = {d.name: d for d in dim_specs}
    if len(by_name) != len(dim_specs):
        raise TpuExportError("a --dim name is given twice; give each dim once")
    input_specs = [export_stage.parse_input(text, by_name) for text in inputs]
    bucket_sizes = compile_stage.parse_bucket_options(buckets)
    compile_stage.resolve_targets(list(targets))
    sharding_request = compile_stage.make_request(*sharding_options)
    source_stem = pathlib.Path(source.partition(":")[0] if ".py:" in source else source.partition("@")[0]).stem
    options["model_name"] = options.get("model_name") or source_stem
    conversion = ConversionOptions(tuple(targets), out or pathlib.Path(source_stem + ".tpu"), buckets=bucket_sizes or None,
                                   sharding=sharding_request, **options)

    from tpuexport.export.huggingface import generation_context, is_huggingface_source

    huggingface = is_huggingface_source(source)
    generation = task == "text-generation"
    # PT2E calibrates and rounds the weights in memory; weight-only modes quantize them as they stream.
    in_memory = options.get("quantize") in ("int8", "int8-dynamic")
    loaded = export_stage.load_source(source, trust_pickle=trust_pickle, inputs=input_specs, dims=dim_specs, checkpoint=checkpoint,
                                      task=task if huggingface or not generation else None, weights_in_memory=in_memory,
                                      memory_budget=conversion.memory_budget if conversion.weights else None)  # plans take no --memory-budget
    if loaded.huggingface is not None and loaded.huggingface.task == "text-generation":
        generation = True
        if options.get("max_context") is None:  # a Hugging Face config says how far its positions go
            options["max_context"] = generation_context(loaded.model)
    if generation:
        conversion = dataclasses.replace(conversion, task="text-generation", max_context=options.get("max_context"))
    artifact = run_conversion(loaded, conversion, progress=_print_stage)
    if artifact.plan_only:
        stderr.print(f"[bold green]planned[/] {source} -> {artifact.path} (plan only: no weights, not verified)", soft_wrap=True)
    else:
        stderr.print(f"[bold green]converted[/] {source} -> {artifact.path}", soft_wrap=True)
    stderr.print(describe_peak_memory(artifact.records.stage_memory), soft_wrap=True)
    from tpuexport.tasks.page_count import target_pages

    for target, line in target_pages(artifact.manifest).items():
        stderr.print(f"KV cache pages on {target}: {line}", soft_wrap=True)
    budget = artifact.manifest.get("build", {}).get("memory_budget")
    if budget and not artifact.plan_only:  # a plan runs no verification and reads no weights: nothing the budget bounds
        stderr.print(describe_memory_budget(budget), soft_wrap=True)
    for warning in artifact.manifest.get("quantization", {}).get("warnings", []):
        stderr.print(f"[bold yellow]WARNING:[/] {warning}", soft_wrap=True)
    if as_json:
        click.echo(json.dumps(summary(artifact), indent=2))


def parse_sizes(text: str, option: str) -> dict[str, int]:
    """Parses `DIM=S,DIM=S` into {dim: size}.

    Raises:
      TpuExportError: malformed text.
    """
    sizes = {}
    for item in text.split(","):
        name, equals, size = item.partition("=")
        if not equals or not name.strip().isidentifier() or not size.strip().isdigit():
            raise TpuExportError(f"malformed {option} {text!r}: expected DIM=SIZE,DIM=SIZE, e.g. {option} batch=64,seq=512")
        sizes[name.strip()] = int(size)
    return sizes


def _print_stage(stage: str, seconds: float, detail: str) -> None:
    stderr.print(f"  [green]✓[/] {stage:<28} {seconds:7.2f} s  [dim]{detail}[/]", soft_wrap=True)


def describe_peak_memory(stage_memory: dict[str, memory.PeakMemory]) -> str:
    """The convert summary's memory line: "peak memory 4.21 GiB in verify (anonymous 3.90 GiB, mapped
    0.31 GiB); largest child process 1.02 GiB in compile", or "peak memory unknown" (not Linux)."""
    process = memory.largest(stage_memory, "process_bytes")
    if process is None:
        return "peak memory unknown"
    name, peak = process
    text = (f"peak memory {memory.gib(peak.process_bytes)} in {name} (anonymous {memory.gib(peak.anonymous_bytes)}, "
            f"mapped {memory.gib(peak.mapped_bytes)})")
    child = memory.largest(stage_memory, "child_bytes")
    return text + (f"; largest child process {memory.gib(child[1].child_bytes)} in {child[0]}" if child and child[1].child_bytes else "")


def describe_memory_budget(record: dict) -> str:
    """The convert summary's budget line, from the manifest's build "memory_budget": "memory budget
    12 GB (--memory-budget); verification runs within 1.00 GiB of outputs, 2.00 GiB of fill temporaries"."""
    budget = record["budget"]
    known = budget is not None and budget["bytes"] != memory.UNKNOWN
    text = "memory budget " + (memory.MemoryBudget(budget["bytes"], budget["source"]).describe() if known else memory.UNKNOWN)
    if "output_bytes" in record:
        limited = " (set by the budget)" if record["limited_by_budget"] else ""
        text += (f"; verification runs within {memory.gib(record['output_bytes'])} of outputs, "
                 f"{memory.gib(record['fill_bytes'])} of fill temporaries{limited}")
    return text


def summary(artifact) -> dict:
    """The machine-readable summary `convert --json` and `inspect --json` print."""
    manifest = artifact.manifest
    return {
        "artifact": str(artifact.path),
        "format_version": manifest["format_version"],
        "source": manifest["source"],
        "plan_only": artifact.plan_only,
        "precision": manifest["precision"],
        "resolved_precision": manifest.get("resolved_precision", manifest["precision"]),
        "task": artifact.task,
        "entry_points": {name: entry["signature"] for name, entry in manifest["entry_points"].items()},
        **({"generation": manifest["generation"]} if "generation" in manifest else {}),
        "verification": {key: manifest["verification"][key] for key in ("passed", "status", "cases") if key in manifest["verification"]},
        "targets": {
            name: [
                {k: bucket[k] for k in ("entry_point", "name", "sizes", "executable", "memory", "cost", "fits_in_hbm", "hbm_utilization",
                                        "collectives", "decode_step", "paged_step", "kernels") if k in bucket}
                for bucket in target["buckets"]
            ]
            for name, target in manifest["targets"].items()
        },
        **({"sharding": {name: target["sharding"] for name, target in manifest["targets"].items() if "sharding" in target}}
           if any("sharding" in target for target in manifest["targets"].values()) else {}),
        **({"version_sets": manifest["version_sets"]} if "version_sets" in manifest else {}),
        "build": manifest["build"],
        "scanned": [{k: run[k] for k in ("module", "first", "count")} for run in manifest.get("scanned", [])],
        **({"quantization": manifest["quantization"]} if "quantization" in manifest else {}),
        **({"tf_serving": manifest["tf_serving"]} if "tf_serving" in manifest else {}),
        **({"huggingface": {key: value for key, value in manifest["huggingface"].items() if key != "config"}}
           if "huggingface" in manifest else {}),
    }


def describe_kernels(kernels: dict | None) -> str:
    """A bucket's TPU kernels for the inspect table: "flash_attention 512" (its block size) or "-"."""
    used = sorted({f"{use['kernel']} {use['block_sizes']['block_q']}" for use in (kernels or {}).get("attention", []) if use.get("kernel")})
    return ", ".join(used) if (kernels or {}).get("program") == "static with kernels" and used else "-"


@main.command()
@click.argument("artifact_dir", metavar="ARTIFACT", type=click.Path(path_type=pathlib.Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@handles_errors
def inspect(artifact_dir, as_json):
    """Show an artifact's inputs, dims, targets, buckets and figures."""
    from tpuexport.artifact import load
    from tpuexport.signature import ProgramSignature

    artifact = load(artifact_dir)
    data = summary(artifact)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    console = Console(highlight=False, width=200)
    verification = ("plan only (no weights, not verified)" if artifact.plan_only
                    else f"verification {'passed' if data['verification']['passed'] else 'FAILED'}")
    console.print(f"[bold]{artifact.path}[/]  source {data['source']['reference'] or data['source']['kind']}, "
                  f"precision {describe_precision(data)}, {verification}")
    if "huggingface" in data:
        hf = data["huggingface"]
        console.print(f"  hugging face: task {hf['task']}, {hf['architecture']}, revision {hf['revision'] or 'none (not from the cache)'}; "
                      f"files {', '.join(hf['files'].values()) or 'none'}")
    if data.get("generation", {}).get("kind") == "paged":
        generation = data["generation"]
        console.print(f"  text generation over pages: max batch {generation['max_batch']}, max context {generation['max_context']}, "
                      f"{generation['num_pages']} pages of {generation['page_size']} ({generation['capacity_tokens']} positions), cache "
                      f"{generation['cache_shape']} {generation['dtype']} ({generation['cache_bytes'] / 2**20:.2f} MiB)")
        from tpuexport.tasks.page_count import target_pages

        for target, line in target_pages(artifact.manifest).items():
            console.print(f"  {target}: {line}")
    elif "generation" in data:
        generation = data["generation"]
        cross = (f" + cross {generation['cross_shape']} x2 (max source {generation['max_source']})" if "cross_shape" in generation else "")
        from tpuexport.export.cache_specs import GenerationSpec

        # An encoder-decoder's generation record is not a GenerationSpec's; only a decoder's has these layers.
        states = GenerationSpec.from_json(generation).describe_states() if {"conv_layers", "indexed_layers", "recurrent_layers"} & set(generation) else ""
        console.print(f"  text generation: max batch {generation['max_batch']}, max context {generation['max_context']}, cache "
                      f"{generation['layout']} {generation['cache_shape']} "
                      f"{'int8 x2 + ' + generation['scale_dtype'] + ' scales ' + str(generation['scale_shape']) + ' x2' if generation.get('kv_cache_dtype') == 'int8' else generation['dtype'] + ' x2'}"
                      f"{cross}{states} ({generation['cache_bytes'] / 2**20:.2f} MiB)"
                      f"{_describe_window_cache(generation)}")
    named = len(data["entry_points"]) > 1  # a forward model's one entry point goes without its name
    for entry_point, signature in data["entry_points"].items():
        signature = ProgramSignature.from_json(signature)
        prefix = f"{entry_point} " if named else ""
        for dim in signature.dims:
            console.print(f"  {prefix}dim {dim.name}: {dim.range_text} (example {dim.example})")
        for kind, specs in (("input", signature.inputs), ("output", signature.outputs)):
            for spec in specs:
                # Printed without markup: rich would take "[batch, seq]" for a style tag and drop it.
                held = "".join(f"; each row holds {held.count} x token {held.token} for {held.media}" for held in spec.placeholders)
                console.print(f"  {prefix}{kind} {spec.name}: {spec.dtype}[{', '.join(map(str, spec.shape))}]{held}", markup=False)
    for name, plan in ((f"{target} {entry}" if named else target, plan) for target, plans in data.get("sharding", {}).items()
                       for entry, plan in plans.items()):
        split = {weight: spec for weight, spec in plan["weights"].items() if any(entry is not None for entry in spec)}
        console.print(f"  {name}: mesh {describe_mesh(plan['mesh'])}, {plan['preset']}, {len(split)}/{len(plan['weights'])} weights split; "
                      f"inputs {', '.join(f'{n} {describe_spec(spec)}' for n, spec in plan['inputs'].items())}")
    for run in data["scanned"]:
        console.print(f"  scanned {run['module']} {run['first']}-{run['first'] + run['count'] - 1} ({run['count']} blocks, weights stacked)")
    for line in describe_weight_only(data.get("quantization", {})):
        console.print(f"  {line}")
    if "version_sets" in data:  # --compile-env: each set's executables are rows of their own, as <target>@<version set>
        console.print(f"  version sets: {', '.join(data['version_sets'])} (the first converted here, the others by --compile-env)")
    table = Table("target", "bucket", "HBM per chip", "of HBM", "collectives", "GFLOP", "est. µs", "kernels", "executable")
    rows = [*data["targets"].items(), *((f"{target}@{set_name}", executables["buckets"]) for target, record in artifact.manifest["targets"].items()
                                        for set_name, executables in record.get("version_sets", {}).items())]
    for name, buckets in rows:
        for bucket in buckets:
            table.add_row(
                name, f"{bucket['entry_point']} {bucket['name']}" if named else bucket["name"], f"{bucket['memory']['total_bytes'] / 2**20:.2f} MiB", f"{bucket['hbm_utilization']:.4%}",
                describe_collectives(bucket.get("collectives")), f"{bucket['cost']['flops'] / 1e9:.4f}",
                describe_microseconds(bucket["cost"]["optimal_seconds"]), describe_kernels(bucket.get("kernels")), bucket["executable"],
            )
    console.print(table)


def cluster_options(command):
    """The options of a multi-process run (one process per host of a multi-host slice, docs/multihost.md)."""
    options = [
        click.option("--coordinator", metavar="HOST:PORT", help="Process 0's address for jax.distributed (multi-host slices; every "
                     "process gives the same). Without it on a Cloud TPU VM of a multi-host slice, JAX reads the TPU metadata."),
        click.option("--num-processes", type=int, help="Processes (hosts) of the run, with --coordinator."),
        click.option("--process-id", type=int, help="This process's index, 0 (the leader: it serves and prints) to N-1 (followers)."),
        click.option("--process-timeout", type=float, default=60.0, show_default=True,
                     help="Seconds to wait for the coordinator at start, for every follower to take each step, and for each step to end."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _cluster(coordinator, num_processes, process_id, timeout, artifacts):
    """The Cluster of a multi-process run, or None for one process: the flags' (checked when joining),
    or on a machine with TPU chips serving a target of several hosts, the Cloud TPU metadata's."""
    from tpuexport.artifact import load
    from tpuexport.devices import tpu_chips_on_this_machine
    from tpuexport.runtime.processes import Cluster

    if coordinator is not None or num_processes is not None or process_id is not None:
        return Cluster(coordinator, num_processes, process_id, timeout)
    multi_host = any(target.get("processes", 1) > 1 for path in artifacts for target in load(path).manifest["targets"].values())
    return Cluster(None, None, None, timeout) if multi_host and tpu_chips_on_this_machine() else None


@main.command()
@click.argument("artifact_dir", metavar="ARTIFACT", type=click.Path(path_type=pathlib.Path))
@click.option("--tokens", "token_lists", multiple=True, metavar="ID,ID,...",
              help="A prompt's token ids (repeat for several prompts, up to the artifact's max batch).")
@click.option("--prompt", "texts", multiple=True, metavar="TEXT",
              help="A prompt as text, encoded with the tokenizer the artifact carries (a Hugging Face source's); repeat for several.")
@click.option("--features", "features_file", type=click.Path(path_type=pathlib.Path), metavar="FILE.npy",
              help="An audio encoder-decoder's (Whisper's) sources: a numpy file of float features [batch, mel bins, frames].")
@click.option("--max-new-tokens", type=int, default=32, show_default=True, help="Tokens to generate per prompt.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0: the greedy token; above 0, sampled (on the device).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Sample from the smallest set of likeliest tokens whose probability reaches it.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Sample from the K likeliest tokens (0: all).")
@click.option("--seed", type=int, help="Seed of the draws (the same seed, prompt and options give the same tokens) [default: random].")
@click.option("--ignore-eos", is_flag=True, help="Run on past the model's end-of-sequence tokens (its generation_config.json's).")
@cluster_options
@handles_errors
def generate(artifact_dir, token_lists, texts, features_file, max_new_tokens, temperature, top_p, top_k, seed, ignore_eos,
             coordinator, num_processes, process_id, process_timeout):
    """Generation with a text-generation artifact (prefill, then decode steps over the KV cache, each token drawn by the
    sample entry point: greedy unless --temperature), printing each step's tokens as they come (one line per step, one
    id per prompt, "-" once a prompt has stopped); with --prompt, then each prompt's new text. A prompt stops at an
    end-of-sequence token unless --ignore-eos. An audio encoder-decoder (Whisper) generates from --features FILE.npy.
    Runs the executables of the target matching the devices JAX sees (JAX_PLATFORMS); on a CPU host without one, the
    lowered program on CPU. On a multi-host slice every host runs the same command with its --process-id; process 0
    prints, the others run its steps."""
    from tpuexport.artifact import load
    from tpuexport.lower.sampling import Sampling

    if sum(map(bool, (token_lists, texts, features_file))) != 1:
        raise TpuExportError("give the prompts either as --tokens ID,ID,... or as --prompt TEXT (one of them, repeatable), "
                             "or an audio model's sources as --features FILE.npy")
    sampling = Sampling(temperature, top_p, top_k, seed)
    artifact = load(artifact_dir)
    tokenizer = artifact.tokenizer() if texts else None
    if features_file:
        prompts = artifact.feature_sources(read_features(features_file))
    else:
        prompts = [parse_tokens(text) for text in token_lists] or [tokenizer(text)["input_ids"] for text in texts]
    generated: list[list[int]] = [[] for _ in prompts]
    cluster = _cluster(coordinator, num_processes, process_id, process_timeout, [artifact_dir])
    out = _stdout_kept_for_tokens() if cluster is not None else sys.stdout
    runner = _generation_runner(artifact, cluster)
    if runner is not None and runner.mirror is not None and not runner.mirror.leader:
        runner.follow()
        return
    try:
        for step in (runner or artifact).stream(prompts, max_new_tokens, sampling, ignore_eos):
            click.echo(" ".join("-" if token is None else str(token) for token in step), file=out)
            for row, token in enumerate(step):
                if token is not None:
                    generated[row].append(token)
    finally:
        if runner is not None:
            runner.close()
    stops = () if ignore_eos else artifact.eos_token_ids
    for tokens in generated if tokenizer else ():
        click.echo(tokenizer.decode(tokens[:-1] if tokens and tokens[-1] in stops else tokens), file=out)


def _stdout_kept_for_tokens():
    """A file on the process's stdout, file descriptor 1 then pointing at stderr: gloo (the CPU
    collectives of a multi-process run) prints its connection lines on descriptor 1 from C++, which
    would mix them into the tokens."""
    import os

    sys.stdout.flush()
    tokens = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return tokens


def _generation_runner(artifact, cluster=None):
    """The runner of the artifact's target matching the devices JAX sees, or None where those are CPUs
    that no target's executables match (generation then runs the lowered program on CPU, as verified)
    in a single process.

    Raises:
      TpuExportError: accelerators that no target matches (naming what differs), or a multi-process
        run that cannot load a target's executables.
    """
    from tpuexport.devices import runtime_devices
    from tpuexport.runtime import open_runner

    try:
        return open_runner(artifact, cluster=cluster)
    except TpuExportError:
        if runtime_devices()[0].platform == "cpu" and cluster is None:
            return None
        raise


def read_features(path: pathlib.Path):
    """The array a --features file holds (numpy's .npy format, no pickled objects).

    Raises:
      TpuExportError: a missing or unreadable file.
    """
    import numpy as np

    if not path.is_file():
        raise TpuExportError(f"--features {path}: no such file; give a .npy file of float features [batch, mel bins, frames] "
                             "(written with numpy.save)")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError) as error:
        raise TpuExportError(f"--features {path} is not a numpy .npy array ({' '.join(str(error).split())[:120]}); "
                             "write the features with numpy.save(FILE, array)") from None


def parse_tokens(text: str) -> list[int]:
    """Parses `1,2,3` into token ids.

    Raises:
      TpuExportError: malformed text.
    """
    items = [item.strip() for item in text.split(",")]
    if not items or not all(item.isdigit() for item in items):
        raise TpuExportError(f"malformed --tokens {text!r}: expected token ids separated by commas, e.g. --tokens 1,2,3")
    return [int(item) for item in items]


def describe_weight_only(section: dict) -> list[str]:
    """inspect's lines for a weight-only artifact: the scheme, then each quantized weight (none for others)."""
    if "weights" not in section:
        return []
    ratio = section["weight_bytes"]["ratio"]
    lines = [f"quantized {section['mode']}: {len(section['weights'])} weights, weight bytes {ratio}x f32; {section['scheme']}"]
    for name, entry in section["weights"].items():
        if "kernel_shape" in entry:  # a convolution's weight: one scale per output channel, stored as a matrix
            lines.append(f"  {name}: int{entry['bits']}, convolution {entry['kernel_shape']} per output channel, "
                         f"scales {entry['scale']}")
            continue
        group = "per output channel" if entry["bits"] == 8 else f"groups of {entry['group_size']}"
        lines.append(f"  {name}: int{entry['bits']}, {group} along axis {entry['axis']}, scales {entry['scale']}")
    return lines


def describe_microseconds(seconds: float | None) -> str:
    """A time estimate in µs, or "unknown" where XLA gives none."""
    return "unknown" if seconds is None else f"{seconds * 1e6:.1f}"


def describe_precision(data: dict) -> str:
    """"auto (bf16)": the requested precision and, when they differ, what the program computes in."""
    resolved = data["resolved_precision"]
    return data["precision"] if resolved == data["precision"] else f"{data['precision']} ({resolved})"


def describe_mesh(mesh: dict) -> str:
    """A manifest mesh as "data=2,model=4"."""
    return ",".join(f"{axis}={size}" for axis, size in zip(mesh["axes"], mesh["shape"]))


def describe_spec(spec: list) -> str:
    """A manifest PartitionSpec as "P(data, None)"."""
    return "P(" + ", ".join("None" if entry is None else "+".join(entry) if isinstance(entry, list) else entry for entry in spec) + ")"


def describe_collectives(collectives: dict | None) -> str:
    """Collectives as "all-reduce x4 0.06 MiB, ..." ("-" for a single chip)."""
    if collectives is None:
        return "-"
    return ", ".join(f"{kind} x{entry['count']} {entry['bytes'] / 2**20:.2f} MiB" for kind, entry in collectives.items()) or "none"


@main.command()
@click.argument("artifact_dir", metavar="ARTIFACT", type=click.Path(path_type=pathlib.Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--junit", "junit_path", type=click.Path(path_type=pathlib.Path), metavar="FILE",
              help="Also write a JUnit XML report (one testcase per check) for CI.")
@click.option("--recompile", is_flag=True, help="Recompile every executable and report compiler drift.")
@click.option("--strict", is_flag=True, help="Fail on compiler drift instead of warning.")
@click.option("--against", metavar="SOURCE", help="Reload the original model (file.py:factory, .pt2) and compare on fresh inputs.")
@click.option("--runtime-env", metavar="PYTHON",
              help="Instead: check that the environment of this Python (a serving image's jax/jaxlib/libtpu) loads the artifact's "
                   "executables with 0 compilations, or its StableHLO (warning); runs no model; exit 0 or 2, one line.")
@click.option("--target", help="With --runtime-env: the target to load [default: the one matching that environment's devices].")
@handles_errors
def verify(artifact_dir, as_json, junit_path, recompile, strict, against, runtime_env, target):
    """Check an artifact before release: file hashes, golden outputs, SavedModel; exit 1 if a check fails (always for a plan)."""
    from tpuexport.gate import PLAN_ONLY, verify_artifact, write_junit

    if runtime_env:
        from tpuexport.runtime.runtime_env import check_runtime_env

        checked = check_runtime_env(artifact_dir, runtime_env, target)
        if as_json:
            click.echo(json.dumps(dataclasses.asdict(checked), indent=2))
        stderr.print(checked.message if checked.loads == "stablehlo" else f"[bold green]verify passed[/] {checked.message}",
                     soft_wrap=True, highlight=False, markup=checked.loads != "stablehlo")
        return
    if target:
        raise TpuExportError("--target goes with --runtime-env (the target that environment loads); drop it")

    report = verify_artifact(artifact_dir, recompile=recompile, strict=strict, against=against)
    if junit_path:
        write_junit(report, junit_path)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        _print_gate_table(report)
    failed = PLAN_ONLY if report.plan_only else ", ".join(check.name for check in report.failures())
    stderr.print(f"[bold green]verify passed[/] {report.artifact}" if report.passed
                 else f"[bold red]verify failed[/] {report.artifact}: {failed}", soft_wrap=True)
    sys.exit(report.exit_code)


def _print_gate_table(report) -> None:
    colours = {"passed": "green", "failed": "bold red", "warning": "yellow", "skipped": "dim"}
    table = Table("check", "result", "seconds", "detail")
    for check in report.checks:
        table.add_row(check.name, f"[{colours[check.status]}]{check.status}[/]", f"{check.seconds:.2f}", check.message)
    Console(highlight=False).print(table)


@main.command()
@click.argument("artifacts", metavar="ARTIFACT...", nargs=-1, required=True, type=click.Path(path_type=pathlib.Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (both APIs).")
@click.option("--port", default=8501, show_default=True, type=int, help="REST port (TF Serving's REST API).")
@click.option("--grpc-port", default=8500, show_default=True, type=int, help="gRPC port (PredictionService); 0 for no gRPC server.")
@click.option("--batch-timeout-ms", default=2.0, show_default=True, type=float,
              help="How long a request waits for concurrent ones to batch with, up to the largest bucket (0: no batching).")
@click.option("--target", help="Target whose executables to serve [default: the one matching this host's devices].")
@click.option("--allow-recompile", is_flag=True, help="Compile the StableHLO when an artifact's compile key differs from this host.")
@click.option("--max-body-mb", default=64.0, show_default=True, type=float, help="Largest REST request body.")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Paged artifacts: requests whose prompts begin alike share the KV cache pages of that prefix (not prefilled again).")
@cluster_options
@handles_errors
def serve(artifacts, host, port, grpc_port, batch_timeout_ms, target, allow_recompile, max_body_mb, prefix_caching, coordinator, num_processes,
          process_id, process_timeout):
    """Serve artifacts with TF Serving's REST and gRPC APIs, from their AOT executables (no compiling). On a multi-host
    slice every host runs the same command with its --process-id: process 0 serves, the others run its steps."""
    from tpuexport.serve import serve as run_server

    run_server(list(artifacts), host=host, port=port, grpc_port=grpc_port or None, batch_timeout_ms=batch_timeout_ms,
               allow_recompile=allow_recompile, target=target, max_body_bytes=int(max_body_mb * 2**20), prefix_caching=prefix_caching,
               cluster=_cluster(coordinator, num_processes, process_id, process_timeout, artifacts))


# Its own command rather than a mode of `serve`: it reads a manifest and prints, like `inspect`, on any machine
# (no TPU, no serve extra), while serve's options are those of a running server.
@main.command()
@click.argument("artifact_dir", metavar="ARTIFACT", type=click.Path(path_type=pathlib.Path))
@click.option("--target", required=True, help="The artifact's target to serve (v5e, v5e-8, v5e-16, v5p-16, cpu, cpu-2x4, ...).")
@click.option("--kind", default="kubernetes", show_default=True, help="What to write: kubernetes (YAML manifests).")
@click.option("--image", required=True, help="Container image with tpuexport[serve] and the jax, jaxlib and libtpu the artifact was "
              "compiled with.")
@click.option("--artifact-uri", required=True, metavar="URI", help="Where the pods find the artifact: gs://BUCKET/PATH (mounted "
              "read-only by GKE's Cloud Storage FUSE CSI driver) or an absolute path in the pod.")
@click.option("--name", help="Name of the Kubernetes objects [default: from the artifact's directory name].")
@click.option("--replicas", type=int, default=1, show_default=True, help="Pods of a single-host target, or slices (groups) of a "
              "multi-host one.")
@click.option("--port", type=int, default=8501, show_default=True, help="serve's REST port (and the Service's).")
@click.option("--grpc-port", type=int, default=8500, show_default=True, help="serve's gRPC port (and the Service's); 0 for none.")
@click.option("--coordinator-port", type=int, default=8476, show_default=True, help="The leader's jax.distributed port (multi-host).")
@click.option("--process-timeout", type=float, default=60.0, show_default=True, help="serve's --process-timeout (multi-host).")
@click.option("--service-account", help="The pods' Kubernetes service account (one that may read the bucket).")
@click.option("-o", "--out", type=click.Path(path_type=pathlib.Path), help="Write the YAML here [default: stdout].")
@handles_errors
def deployment(artifact_dir, target, kind, image, artifact_uri, name, replicas, port, grpc_port, coordinator_port, process_timeout,
               service_account, out):
    """Write Kubernetes manifests serving an artifact's target on GKE: a Deployment and a Service for one host, a
    LeaderWorkerSet (one pod per host) and a Service for its leader for a multi-host slice (docs/deployment.md)."""
    from tpuexport.artifact import load
    from tpuexport.deployment import PodOptions, default_name, render, target_hosts

    artifact = load(artifact_dir)
    hosts = target_hosts(artifact.manifest, target)
    name = name if name is not None else default_name(artifact.path.name)
    if not name:
        raise TpuExportError(f"no Kubernetes name can be made from {artifact.path.name!r}; give --name (e.g. --name my-model)")
    options = PodOptions(name, image, artifact_uri, replicas, port, grpc_port, coordinator_port, process_timeout, service_account)
    text = render(kind, hosts, options, artifact.path.name)
    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        raise TpuExportError(f"-o {out} is a directory; give a file name such as {out / 'deployment.yaml'}" if out.is_dir()
                             else f"-o {out}: the directory {out.parent} does not exist; create it first")
    if artifact.plan_only:
        stderr.print(f"[yellow]note:[/] {artifact.path} is a plan without weights; put the converted artifact at {artifact_uri}",
                     soft_wrap=True)
    if out is None:
        click.echo(text, nl=False)
    else:
        out.write_text(text)
        stderr.print(f"wrote {out}: {hosts.target} on {hosts.hosts} host(s)", soft_wrap=True)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the targets as JSON on stdout.")
@handles_errors
def targets(as_json):
    """List the TPU chips with their per-chip figures, and the slices with chips and HBM."""
    from tpuexport.compile import SLICES, TARGETS

    if as_json:
        click.echo(json.dumps([
            {**dataclasses.asdict(t), "hbm_bytes_per_device": t.hbm_bytes_per_device, "total_hbm_bytes": t.hbm_bytes * t.chips}
            for t in [*TARGETS.values(), *SLICES.values()]
        ], indent=2))
        return
    console = Console(highlight=False, width=200)
    table = Table("target", "generation", "HBM", "bf16 TFLOP/s", "int8 TOP/s", "HBM GB/s", "topology", "source", title="chips")
    for t in TARGETS.values():
        table.add_row(t.name, t.generation, f"{t.hbm_bytes / 2**30:.0f} GiB", f"{t.peak_bf16_tflops:g}",
                      f"{t.peak_int8_tops:g}" if t.peak_int8_tops else "-", f"{t.hbm_gbps:g}", t.topology, t.source)
    console.print(table)
    table = Table("slice", "name counts", "chips", "devices (mesh size)", "HBM per chip", "HBM per device", "total HBM", "topology",
                  title="slices (also v5litepod-N for v5e-N, tpu7x-N for 7x-N)")
    for t in SLICES.values():
        table.add_row(t.name, t.name_counts, str(t.chips), str(t.devices), f"{t.hbm_bytes / 2**30:.0f} GiB",
                      f"{t.hbm_bytes_per_device / 2**30:.0f} GiB", f"{t.hbm_bytes * t.chips / 2**30:,.0f} GiB", t.topology)
    console.print(table)
    console.print("v5e and v6e slice names count chips; v5p and 7x names count TensorCores, two per chip (v5p-8 and 7x-8 are "
                  "4 chips). A 7x chip is two devices with half its HBM each. v4 slices are not offered: libtpu's compile-only "
                  "v4 topology has one device per TensorCore, while v4 slices run one device per chip (megacore).")


def run() -> None:
    """The `tpuexport` program: main(), then out without the interpreter's teardown.

    Python's exit collects every reference cycle of the libraries a command imported: 1-1.5 s after a
    conversion (gc.freeze() would skip the collection, but jax's nanobind bindings then print every
    object it left as a leak). The exit handlers still run and the streams are flushed; only the
    teardown is left to the OS. A traceback (a bug) exits as Python does. Only the program does this,
    not `main` called inside a process.
    """
    try:
        main()
    except SystemExit as done:
        atexit._run_exitfuncs()  # what Python's exit runs first: temporary files' finalizers, logging, ...
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(done.code if isinstance(done.code, int) else 0 if done.code is None else 1)


if __name__ == "__main__":
    run()
