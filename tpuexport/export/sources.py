"""Loading a model from what the user points at: a .pt2, a `file.py:factory`, or an opt-in pickle.

The factory contract (also in docs/cli.md): `factory()` takes no arguments and returns either
  - a dict with keys "model" (an nn.Module or ExportedProgram), "args" (a tuple of example inputs)
    and optionally "dynamic_shapes" (torch.export's format) and "calibration" (an iterable of
    argument tuples, used by quantization), or
  - a tuple (model, args) or (model, args, dynamic_shapes), or
  - for --task text-generation, the Hugging Face causal LM alone (its entry points' inputs are
    tpuexport's own, export/generation.py).
The dict may also hold "checkpoint": where the model's weights are (a path or a Mapping name ->
tensor, see checkpoints.py), for a model built with its parameters on the meta device.

With --checkpoint, the factory runs within `parameters_on_meta()`: the model it builds holds no
parameter memory, whatever its size, and its weights stream from the checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import pathlib
import pickle
import sys

import torch

from tpuexport.errors import TpuExportError
from tpuexport.logs import TORCHAO_LOGGERS, quiet_loggers
from tpuexport.memory import MemoryBudget
from tpuexport.export import huggingface
from tpuexport.export.checkpoints import Checkpoint, check_weights_fit, open_checkpoint, parameters_on_meta
from tpuexport.export.loaded import LoadedSource, SourceInfo, file_sha256
from tpuexport.export.specs import DimSpec, InputSpec, example_args


def load_source(
    reference: str,
    *,
    trust_pickle: bool = False,
    inputs: list[InputSpec] = (),
    dims: list[DimSpec] = (),
    checkpoint: str | pathlib.Path | None = None,
    task: str | None = None,
    weights_in_memory: bool = False,
    memory_budget: MemoryBudget | None = None,
) -> LoadedSource:
    """Loads the model a command-line SOURCE names.

    Args:
      reference: `model.pt2`, `path/to/file.py:factory`, `model.pt` / `model.pth`, or a Hugging
        Face model directory / `hf:ORG/NAME` (export/huggingface.py).
      trust_pickle: allow unpickling a whole module (pickles run arbitrary code on load).
      inputs: --input specs, required for pickles and refused for the other kinds.
      dims: --dim specs the inputs refer to.
      checkpoint: a --checkpoint path (file.py:factory sources only): the factory builds the model
        with its parameters on the meta device and the weights stream from there.
      task: a Hugging Face source's task (optimum's names; None or "auto" from its config).
      weights_in_memory: a Hugging Face source's weights are read into the model instead of
        streamed (quantization rounds them in memory).
      memory_budget: the conversion's budget, or None: weights the source reads into memory (a Hugging
        Face directory's read in, a .pt2 or pickled module) that alone exceed it are refused before
        they are read, their size taken from the safetensors headers or the file's size.
    Returns:
      The LoadedSource.
    Raises:
      TpuExportError: missing file, unknown kind, refused pickle, bad factory, misplaced specs,
        a checkpoint for a source that is not a factory, or an unreadable checkpoint.
    """
    if huggingface.is_huggingface_source(reference):
        if inputs or checkpoint is not None:
            raise TpuExportError("--input and --checkpoint do not apply to a Hugging Face source (its config names the inputs, "
                                 "its directory holds the weights); drop them, and use --dim to change a dim's range")
        return huggingface.load_huggingface(reference, task, dims, weights_in_memory, memory_budget)
    if task not in (None, "auto"):
        raise TpuExportError(f"--task applies to a Hugging Face model directory or hf:ORG/NAME, not {reference}; drop it")
    path_text, _, factory = reference.partition(":") if ".py:" in reference else (reference, "", "")
    path = pathlib.Path(path_text)
    if not path.is_file():
        raise TpuExportError(f"source {path_text!r} does not exist; pass a Hugging Face model directory, hf:ORG/NAME, "
                             "a .pt2 file, a file.py:factory or a .pt file")
    suffix = path.suffix.lower()
    if suffix in (".pt2", ".pt", ".pth"):  # read whole into memory; the file's size bounds the weights' from above
        check_weights_fit(path.stat().st_size, f"{path} (its weights are read whole)", memory_budget,
                          "give a larger --memory-budget, or stream the weights: a file.py:factory that builds the model on the "
                          "meta device, with --checkpoint naming its weights (docs/checkpoints-and-plans.md)")
    if checkpoint is not None and suffix != ".py":
        raise TpuExportError(f"--checkpoint needs a file.py:factory source that builds the model, not {path.name}; "
                             "write a factory that returns the model (its weights come from the checkpoint)")
    if suffix == ".py":
        if not factory:
            raise TpuExportError(f"source {reference!r} names no factory; write it as {path_text}:FUNCTION")
        _refuse_specs(inputs, dims, "a file.py:factory source (the factory returns its own example args)")
        return _load_factory(path, factory, reference, open_checkpoint(checkpoint) if checkpoint is not None else None)
    if suffix == ".pt2":
        _refuse_specs(inputs, dims, "a .pt2 source (the saved program carries its own inputs and dims)")
        return _load_pt2(path, reference)
    if suffix in (".pt", ".pth"):
        return _load_pickle(path, reference, trust_pickle, inputs, dims)
    raise TpuExportError(
        f"source {path_text!r} has an unknown kind {suffix or '(no suffix)'!r}; use .pt2, file.py:factory, or .pt with --trust-pickle"
    )


def _refuse_specs(inputs, dims, what):
    if inputs or dims:
        raise TpuExportError(f"--input/--dim do not apply to {what}; drop them")


def _load_pt2(path: pathlib.Path, reference: str) -> LoadedSource:
    try:
        program = torch.export.load(str(path))
    except Exception as error:  # torch raises many kinds here (zip, version, schema errors)
        raise TpuExportError(
            f"cannot read {path} as a torch.export program ({type(error).__name__}: {_first_line(error)}); "
            "save it with torch.export.save"
        ) from None
    return LoadedSource(program, None, None, None, _source_info("pt2", path))


def _load_factory(path: pathlib.Path, factory: str, reference: str, checkpoint: Checkpoint | None) -> LoadedSource:
    module_name = f"_tpuexport_source_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))
    # Registered while it runs, as an import would: dataclasses (and typing) look their module up there.
    sys.modules[module_name] = module
    try:  # a factory importing transformers imports torchao, whose import-time warnings are noise (logs.py)
        with quiet_loggers(*TORCHAO_LOGGERS):
            spec.loader.exec_module(module)
    except Exception as error:
        raise TpuExportError(f"importing {path} failed ({type(error).__name__}: {_first_line(error)}); fix the file") from None
    finally:
        sys.path.pop(0)
        sys.modules.pop(module_name, None)
    function = getattr(module, factory, None)
    if not callable(function):
        raise TpuExportError(f"{path} has no function {factory!r}; name a function defined in that file")
    try:
        with parameters_on_meta() if checkpoint is not None else contextlib.nullcontext(), quiet_loggers(*TORCHAO_LOGGERS):
            produced = function()
    except Exception as error:
        raise TpuExportError(f"{reference}() raised {type(error).__name__}: {_first_line(error)}; fix the factory") from None
    model, args, dynamic_shapes, calibration, returned_checkpoint = _unpack_factory_result(produced, reference)
    if checkpoint is None and returned_checkpoint is not None:
        checkpoint = open_checkpoint(returned_checkpoint)
    info = _source_info("python", path, factory)
    if checkpoint is not None:
        info = dataclasses.replace(info, checkpoint=checkpoint.name)
    return LoadedSource(model, args, dynamic_shapes, calibration, info, checkpoint=checkpoint)


def _unpack_factory_result(produced, reference):
    contract = ("return {'model': ..., 'args': (...), 'dynamic_shapes': ...} or (model, args[, dynamic_shapes]), or the model "
                "alone for --task text-generation")
    if isinstance(produced, torch.nn.Module):  # --task text-generation builds its own entry points' inputs
        return produced, None, None, None, None
    if isinstance(produced, dict):
        unknown = set(produced) - {"model", "args", "dynamic_shapes", "calibration", "checkpoint"}
        if "model" not in produced or unknown:
            raise TpuExportError(f"{reference}() returned a dict with keys {sorted(produced)}; {contract}")
        model, args = produced["model"], produced.get("args")
        dynamic_shapes, calibration = produced.get("dynamic_shapes"), produced.get("calibration")
        checkpoint = produced.get("checkpoint")
    elif isinstance(produced, tuple) and len(produced) in (2, 3):
        model, args, dynamic_shapes = (*produced, None)[:3]
        calibration = checkpoint = None
    else:
        raise TpuExportError(f"{reference}() returned {type(produced).__name__}; {contract}")
    if not isinstance(model, (torch.nn.Module, torch.export.ExportedProgram)):
        raise TpuExportError(f"{reference}() returned a model of type {type(model).__name__}; return an nn.Module")
    if isinstance(model, torch.nn.Module) and not isinstance(args, (tuple, type(None))):
        raise TpuExportError(f"{reference}() returned args of type {type(args).__name__}; return a tuple of example inputs")
    return model, args, dynamic_shapes, calibration, checkpoint


def _load_pickle(path, reference, trust_pickle, inputs, dims) -> LoadedSource:
    if not trust_pickle:
        raise TpuExportError(
            f"refusing to unpickle {path}: pickles run arbitrary code when loaded; "
            "pass --trust-pickle if you trust this file, or save the model with torch.export.save as .pt2"
        )
    if not inputs:
        raise TpuExportError(f"{path} is a pickle with no input description; add --input NAME:D0,D1,...[:DTYPE] (and --dim)")
    try:
        model = torch.load(str(path), weights_only=False, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, ModuleNotFoundError) as error:
        raise TpuExportError(f"cannot unpickle {path} ({type(error).__name__}: {_first_line(error)})") from None
    if not isinstance(model, torch.nn.Module):
        raise TpuExportError(
            f"{path} holds a {type(model).__name__}, not a whole nn.Module; "
            "for a state_dict, write a file.py:factory that builds the module and loads it"
        )
    args, dynamic_shapes = example_args(list(inputs), list(dims))
    info = _source_info("pickle", path)
    return LoadedSource(model, args, dynamic_shapes, None, info, tuple(spec.name for spec in inputs))


def _source_info(kind: str, path: pathlib.Path, factory: str = "") -> SourceInfo:
    """Provenance that does not depend on where the file lives (see SourceInfo).

    Args:
      kind: "pt2", "python" or "pickle".
      path: the source file.
      factory: the factory function's name, for "python" sources.
    Returns:
      SourceInfo with the file's name, its sha256, and the reference without a directory.
    """
    return SourceInfo(kind, path.name, file_sha256(path), f"{path.name}:{factory}" if factory else path.name)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
