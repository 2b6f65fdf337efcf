"""Hugging Face model directories as sources: `tpuexport convert ./model-dir --task TASK`.

A source is a directory holding `config.json` and the weights (`*.safetensors`, sharded with an
index or not, or a `pytorch_model.bin`), or `hf:ORG/NAME[@REVISION]`, a model already in the local
Hugging Face cache (never downloaded). For the task (optimum's names, or `auto` from the config's
`architectures`) the model is built with transformers' `AutoModelFor...` class with its parameters
on the meta device, and its weights stream from the directory's checkpoint (export/checkpoints.py).

Inputs are named as the family names them (input_ids, attention_mask, token_type_ids,
pixel_values, pixel_values_videos, input_values, input_features, decoder_input_ids) with dims whose
ranges come from the config and that `--dim NAME=MIN:MAX` overrides (MIN == MAX makes a dim static):
  batch             1..64
  seq               2..the positions the config records (max_position_embeddings, n_positions, ...; 512
                    when it records none), less the rows a position table numbered from its padding
                    index leaves unused (longest_positions)
  decoder_seq       2..the decoder's max positions
  height, width     the config's image_size (or crop_size; static), samples 16000 (static), frames (static);
                    a video model's clips (pixel_values_videos, or 5-d pixel_values) hold the config's
                    num_frames (or frames_per_clip; 8 when it records neither)
Outputs are the tensors of the model's output (logits, last_hidden_state, pooler_output, ...).

Each task maps to a function building the LoadedSource (`Task.build`); `text-generation` gives the
causal LM itself (on the meta device, its weights streamed from the checkpoint as for the other
tasks), which the pipeline converts as prefill and decode entry points over a KV cache
(export/generation.py), its `--max-context` defaulting to the config's `max_position_embeddings`
(`generation_context`).

`transformers` is the optional extra `tpuexport[hf]`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import os
import pathlib
import re
import sys
from typing import Callable

import torch

from tpuexport.errors import TpuExportError
from tpuexport.logs import EXPORT_LOGGERS, TORCHAO_LOGGERS, quiet_loggers
from tpuexport.export.checkpoints import (Checkpoint, check_weights_fit, meta_copy, open_checkpoint, parameters_on_meta, stored_weight_bytes,
                                          with_checkpoint_weights)
from tpuexport.export.generation import check_decoder
from tpuexport.export.language_model import language_model_config, language_model_names, multimodal_model, tied_names
from tpuexport.export.loaded import LoadedSource, SourceInfo, file_sha256
from tpuexport.export.patch_grids import PatchGrid, constants_read, failure_on, made_from_numbers, patch_grid
from tpuexport.export.placeholders import FeatureCountFromValues, count_placeholders, features_method, placeholder_keys
from tpuexport.export.serving_files import ARTIFACT_DIRECTORY, SERVING_FILES, is_tokenizer_file
from tpuexport.export.specs import DimSpec
from tpuexport.inputs import with_placeholders
from tpuexport.signature import Placeholder

HF_PREFIX = "hf:"
INSTALL_HINT = "pip install 'tpuexport[hf]'"
DEFAULT_BATCH = DimSpec("batch", 1, 64)
DEFAULT_MAX_SEQUENCE = 512
DEFAULT_IMAGE_SIZE = 224
DEFAULT_AUDIO_SAMPLES = 16000
DEFAULT_MEL_FRAMES = 3000
DEFAULT_VIDEO_FRAMES = 8
# What a multimodal model's image features may require besides the pixels, fixed for images of one size (_image_constants).
IMAGE_CONSTANTS = ("image_sizes", "spatial_shapes", "pixel_attention_mask")
# Inputs that carry images, clips, audio or a time series (beside or instead of token ids).
MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "input_values", "input_features", "past_values")
# Example sizes the model is traced and first verified at (clamped into the dims' ranges).
EXAMPLE_SIZES = {"batch": 2, "seq": 16, "decoder_seq": 8}


@dataclasses.dataclass(frozen=True)
class HuggingFaceInfo:
    """What the artifact records of a Hugging Face source (manifest "huggingface", files in hf/).

    Attributes:
      task: the task converted (optimum's name).
      architecture: the model class built (e.g. "BertForSequenceClassification").
      model_type: the config's model_type.
      revision: the cache snapshot's commit, or None for a directory outside the cache.
      config: config.json as read.
      files: the serving files found in the source directory, by name (copied into hf/).
      tokenizer_class: the class AutoTokenizer picks for the directory's tokenizer files (its name
        in transformers), None without them. A server loads that class directly: AutoTokenizer
        would read the config through transformers' configuration module, which imports torch.
    """

    task: str
    architecture: str
    model_type: str
    revision: str | None
    config: dict
    files: dict[str, pathlib.Path]
    tokenizer_class: str | None = None

    def manifest_section(self) -> dict:
        """The manifest's "huggingface" section (paths relative to the artifact)."""
        return {"task": self.task, "architecture": self.architecture, "model_type": self.model_type, "revision": self.revision,
                "files": {name: f"{ARTIFACT_DIRECTORY}/{name}" for name in sorted(self.files)}, "config": self.config,
                **({"tokenizer_class": self.tokenizer_class} if self.tokenizer_class else {})}


def serving_record(resolved: "ResolvedModel", architecture: str, model_type: str) -> HuggingFaceInfo:
    """The HuggingFaceInfo of a directory source whose model class is `architecture`: its serving
    files, and the tokenizer class AutoTokenizer picks for them."""
    files = {name: resolved.directory / name for name in SERVING_FILES if (resolved.directory / name).is_file()}
    tokenizer_class = None
    if any(is_tokenizer_file(name) for name in files):
        try:
            tokenizer_class = type(_import_transformers().AutoTokenizer.from_pretrained(str(resolved.directory), local_files_only=True,
                                                                              trust_remote_code=False)).__name__
        except Exception:  # noqa: BLE001 (any failure of transformers') the server's AutoTokenizer meets it again, where it is needed
            tokenizer_class = None
    return HuggingFaceInfo(resolved.task, architecture, model_type, resolved.revision, resolved.config_json, files, tokenizer_class)


@dataclasses.dataclass(frozen=True)
class ModelInput:
    """One input of a task's model: its name, axes (dim names or sizes), dtype and how examples look."""

    name: str
    axes: tuple[str | int, ...]
    dtype: torch.dtype
    high: int = 0  # integer inputs: examples drawn from [0, high); 0 for floats
    placeholders: tuple[Placeholder, ...] = ()  # a multimodal model's token ids: the media tokens each row holds


@dataclasses.dataclass(frozen=True)
class Task:
    """A task as optimum names it.

    Attributes:
      name: e.g. "text-classification".
      auto_classes: transformers' AutoModelFor... class names and their model-type -> class-name
        tables (transformers.models.auto.modeling_auto); the first that lists the config's
        model_type builds the model.
      build: makes the LoadedSource from the resolved pieces (the forward of the model, or another
        program such as a generation loop).
    """

    name: str
    auto_classes: tuple[tuple[str, str], ...]
    build: Callable[["ResolvedModel", list[DimSpec], bool], LoadedSource]


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """A Hugging Face source resolved to a directory, a config and a task (memory_budget: the
    conversion's memory.MemoryBudget, or None, that weights read into memory must fit)."""

    directory: pathlib.Path
    reference: str
    config: object  # a transformers PretrainedConfig
    config_json: dict
    task: str
    auto_class: str
    revision: str | None
    memory_budget: object = None


def _tasks() -> dict[str, Task]:
    forward = _forward_source
    entries = [
        ("feature-extraction", (("AutoModel", "MODEL_MAPPING_NAMES"),)),
        ("fill-mask", (("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),)),
        ("text-classification", (("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),)),
        ("token-classification", (("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),)),
        ("question-answering", (("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),)),
        # Before text-generation, so that --task auto keeps giving a seq2seq LM's forward (the first task whose
        # classes name the config's architecture wins); asked for, text-generation on an encoder-decoder
        # gives encode and decode entry points (export/seq2seq.py).
        ("text2text-generation", (("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),)),
        ("text-generation", (("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
                             ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"))),
        ("image-classification", (("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),)),
        ("semantic-segmentation", (("AutoModelForSemanticSegmentation", "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES"),)),
        ("object-detection", (("AutoModelForObjectDetection", "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES"),)),
        ("depth-estimation", (("AutoModelForDepthEstimation", "MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES"),)),
        ("automatic-speech-recognition", (("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
                                          ("AutoModelForCTC", "MODEL_FOR_CTC_MAPPING_NAMES"))),
        ("audio-classification", (("AutoModelForAudioClassification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),)),
        ("audio-frame-classification", (("AutoModelForAudioFrameClassification", "MODEL_FOR_AUDIO_FRAME_CLASSIFICATION_MAPPING_NAMES"),)),
    ]
    return {name: Task(name, classes, _generation_source if name == "text-generation" else forward) for name, classes in entries}


def is_huggingface_source(reference: str) -> bool:
    """Whether SOURCE names a Hugging Face model: `hf:ORG/NAME` or a directory."""
    return reference.startswith(HF_PREFIX) or pathlib.Path(reference).is_dir()


def load_huggingface(reference: str, task: str | None, dims: list[DimSpec] = (), weights_in_memory: bool = False,
                     memory_budget=None) -> LoadedSource:
    """Loads a Hugging Face model directory (or a cached `hf:ORG/NAME`) for a task.

    Args:
      reference: the directory, or `hf:ORG/NAME[@REVISION]` resolved in the local cache only.
      task: optimum's task name, or None / "auto" for the task of the config's `architectures`.
      dims: --dim overrides of the input dims (see the module docstring).
      weights_in_memory: read the weights into the model (PT2E quantization rounds them in
        memory) instead of streaming them from the checkpoint.
      memory_budget: the conversion's memory.MemoryBudget, or None: weights read into memory that
        alone exceed it are refused before they are read.
    Returns:
      The LoadedSource: the model on the meta device with the directory's checkpoint (or with its
      weights), example inputs, dynamic shapes, and the `huggingface` record for the artifact.
    Raises:
      TpuExportError: transformers missing, a missing directory or cached model, an unreadable
        config, an unknown task or one the architecture does not support, a bad --dim.
    """
    # Reading a directory imports transformers' model classes, and with them torchao (logs.py).
    with quiet_loggers(*TORCHAO_LOGGERS):
        return _load_huggingface(reference, task, dims, weights_in_memory, memory_budget)


def _load_huggingface(reference: str, task: str | None, dims: list[DimSpec], weights_in_memory: bool, memory_budget) -> LoadedSource:
    transformers = _import_transformers()
    directory, revision = _resolve(reference)
    config_path = directory / "config.json"
    try:
        config_json = json.loads(config_path.read_text())
        config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise TpuExportError(f"cannot read {config_path} as a transformers config ({type(error).__name__}: {_first_line(error)}); "
                             "give a directory written by save_pretrained") from None
    except ImportError as error:  # the model type's code imports a package that is missing, or shadowed by a directory
        raise TpuExportError(f"transformers cannot import the code of {config_path}'s model type {config_json.get('model_type')!r} "
                             f"({_first_line(error)}); install the package it names, and run from a directory with no folder of "
                             "that package's name") from None
    tasks = _tasks()
    supported = [name for name, entry in tasks.items() if _auto_class(entry, config) is not None]
    language_model = "text-generation" not in supported and language_model_config(config) is not None
    if language_model:
        supported.append("text-generation")
    task = _choose_task(task, config, tasks, supported, directory, language_model)
    if language_model and task == "text-generation":
        resolved = ResolvedModel(directory, reference, config, config_json, task, "AutoModelForCausalLM", revision, memory_budget)
        return _language_model_source(resolved, list(dims), weights_in_memory)
    resolved = ResolvedModel(directory, reference, config, config_json, task, _auto_class(tasks[task], config), revision, memory_budget)
    return tasks[task].build(resolved, list(dims), weights_in_memory)


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise TpuExportError(f"a Hugging Face source needs transformers, which is not installed; {INSTALL_HINT}") from None
    return transformers


def _resolve(reference: str) -> tuple[pathlib.Path, str | None]:
    """(the model's directory, its cache revision or None)."""
    if reference.startswith(HF_PREFIX):
        return _cached_snapshot(reference)
    directory = pathlib.Path(reference)
    if not directory.is_dir():
        raise TpuExportError(f"source directory {reference!r} does not exist; give a Hugging Face model directory (with config.json)")
    if not (directory / "config.json").is_file():
        raise TpuExportError(f"{reference} has no config.json, so it is not a Hugging Face model directory; "
                             "save the model with save_pretrained, or give a .pt2 / file.py:factory source")
    parent = directory.resolve().parent
    revision = directory.resolve().name if parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", directory.resolve().name) else None
    return directory, revision


@contextlib.contextmanager
def _offline():
    """HF_HUB_OFFLINE=1 while the cache is consulted, restored after."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def _cached_snapshot(reference: str) -> tuple[pathlib.Path, str]:
    """The snapshot directory of `hf:ORG/NAME[@REVISION]` in the local Hugging Face cache; nothing
    is downloaded (local_files_only, HF_HUB_OFFLINE)."""
    repo_id, _, revision = reference.removeprefix(HF_PREFIX).partition("@")
    from huggingface_hub import constants, snapshot_download

    looked_in = pathlib.Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    with _offline():
        try:
            path = pathlib.Path(snapshot_download(repo_id, revision=revision or None, local_files_only=True))
        except Exception as error:  # huggingface_hub raises LocalEntryNotFoundError, HFValidationError, ...
            raise TpuExportError(f"{repo_id}{'@' + revision if revision else ''} is not in the local Hugging Face cache "
                                 f"(looked in {looked_in}: {type(error).__name__}); tpuexport never downloads: "
                                 f"fetch it first (hf download {repo_id}) or give its directory") from None
    if not (path / "config.json").is_file():
        raise TpuExportError(f"the cached {repo_id} ({path}) has no config.json; it is not a transformers model")
    return path, path.name


def _auto_class(task: Task, config) -> str | None:
    """The AutoModelFor... class name that builds the config's model for the task, or None."""
    for auto_class, table in task.auto_classes:
        if _listed_type(config, table) is not None:
            return auto_class
    return None


def _listed_type(config, table: str) -> str | None:
    """The model type under which transformers' table `table` lists the config's model: its own, or,
    for a model whose config type no table lists, the type listing its first architecture built from
    that config class (transformers 5.24 lists Emu3ForCausalLM, MllamaForCausalLM and Musicgen's
    causal LM under their multimodal types, while they take a text config: saved alone, the
    directory names a type, "emu3_text_model", that no task was found for)."""
    from transformers.models.auto import modeling_auto

    entries = getattr(modeling_auto, table, {})
    if config.model_type in entries:
        return config.model_type
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:
        return None
    model_class = getattr(_import_transformers(), architectures[0], None)
    if getattr(model_class, "config_class", None) is not type(config):
        return None
    return next((model_type for model_type, entry in entries.items()
                 if architectures[0] in ((entry,) if isinstance(entry, str) else tuple(entry))), None)


def auto_model_class(name: str, config):
    """transformers' auto class `name` (AutoModel, AutoModelForCausalLM, ...), made to know the config.

    An auto class finds a config's model through the config mapping read backwards, by the config
    class's name. Where that mapping lists one config class under two keys (transformers 5.24 has
    EvollaConfig under "evolla" and under "EvollaModel"), the lookup lands on the alias, which no
    model table lists, and from_config refuses a config whose model type the table does list; a
    model whose config type no table lists (`_listed_type`) has no entry at all. The table's class
    for the model type is then registered for the config class, as transformers' own `register`
    adds a model.
    """
    from transformers.models.auto import modeling_auto

    transformers = _import_transformers()
    auto_class = getattr(transformers, name)
    if type(config) not in auto_class._model_mapping:
        table = next(table for task in _tasks().values() for auto, table in task.auto_classes if auto == name)
        entry = getattr(modeling_auto, table).get(_listed_type(config, table))
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        architectures = list(getattr(config, "architectures", None) or [])
        chosen = next((candidate for candidate in names if candidate in architectures[:1]), names[0] if names else None)
        if chosen is not None and hasattr(transformers, chosen):
            auto_class.register(type(config), getattr(transformers, chosen), exist_ok=True)
    return auto_class


def _class_names(task: Task, config) -> set[str]:
    from transformers.models.auto import modeling_auto

    names = set()
    for _, table in task.auto_classes:
        entry = getattr(modeling_auto, table, {}).get(_listed_type(config, table), ())
        names.update((entry,) if isinstance(entry, str) else entry)
    return names


def _choose_task(task: str | None, config, tasks: dict[str, Task], supported: list[str], directory: pathlib.Path,
                 language_model: bool = False) -> str:
    """The task to convert: the one asked for if the architecture supports it, or the task of the
    config's first architecture for "auto" (`language_model`: text-generation converts a multimodal
    model's language model alone, which "auto" never chooses: the artifact would not take images)."""
    listing = ", ".join(supported) or "none"
    if task in (None, "auto"):
        architectures = list(getattr(config, "architectures", None) or [])
        for name in supported:
            own_task = not (language_model and name == "text-generation")
            if architectures and architectures[0] in _class_names(tasks[name], config) and own_task:
                return name
        alone = ("; --task text-generation converts its language model alone (text in, text out: the image or audio towers are not "
                 "converted)") if language_model else ""
        raise TpuExportError(f"cannot infer the task of {directory}: its config names architectures {architectures or 'none'}, "
                             f"which no task builds; pass --task, one of: {listing}{alone}")
    if task not in tasks:
        raise TpuExportError(f"unknown task {task!r}; {config.model_type} supports: {listing} (or auto)")
    if task not in supported:
        raise TpuExportError(f"task {task!r} is not supported by {config.model_type}; it supports: {listing} (or auto)")
    return task


def _forward_source(resolved: ResolvedModel, dims: list[DimSpec], weights_in_memory: bool) -> LoadedSource:
    """The task's AutoModelFor... forward as the program: model on the meta device, inputs and dims
    from the config, weights streamed from the checkpoint (or read, with `weights_in_memory`)."""
    config = resolved.config
    auto_class = auto_model_class(resolved.auto_class, config)
    dtype = _config_dtype(config)
    with parameters_on_meta():
        model = auto_class.from_config(config, dtype=dtype).eval()
    wrapped, args, dynamic_shapes = forward_program(model, dims)
    checkpoint = _checkpoint(resolved.directory, wrapped.model, "model.")
    info = _source_info(resolved)
    record = serving_record(resolved, type(model).__name__, config.model_type)
    if checkpoint is None:  # tensors transformers converts when loading (not only renames): its own loading reads them
        _check_in_memory_fit(resolved, "transformers converts some of its tensors as it loads them")
        loaded = _from_pretrained(auto_class, resolved.directory, dtype)
        loaded.config.use_cache = False
        traceable_experts(loaded)
        wrapped = named_forward(loaded, wrapped.input_names, wrapped.placeholders, wrapped.constants)
    elif weights_in_memory:
        _check_in_memory_fit(resolved, "--quantize int8/int8-dynamic rounds them there")
        wrapped, checkpoint = with_checkpoint_weights(wrapped, checkpoint), None
    return LoadedSource(wrapped, args, dynamic_shapes, None, info, checkpoint=checkpoint, huggingface=record,
                        at_ranges=functools.partial(_at_ranges, model, dims), placeholders=wrapped.placeholders)


def _at_ranges(model: torch.nn.Module, given: list[DimSpec], ranges: dict[str, tuple[int, int]]
               ) -> tuple[tuple, dict, dict[str, tuple[int, int]]] | None:
    """LoadedSource.at_ranges of a directory's forward: its example inputs with `ranges` in place of the
    config's; None when the user gave one of those dims (--dim) or the code fixes a dim other than
    batch to one size (the artifact would take that size only). A batch the code fixes (RT-DETR's
    `batch_size = len(source_flatten)` at the example's 2) becomes one row a call: batch 1."""
    if any(spec.name in ranges for spec in given):
        return None
    if any(low == high and name != "batch" for name, (low, high) in ranges.items()):
        return None
    ranges = {name: (1, 1) if name == "batch" and low == high else (low, high) for name, (low, high) in ranges.items()}
    _, args, dynamic_shapes = forward_program(model, [*given, *(DimSpec(name, low, high) for name, (low, high) in ranges.items())])
    return args, dynamic_shapes, ranges


def _generation_source(resolved: ResolvedModel, dims: list[DimSpec], weights_in_memory: bool) -> LoadedSource:
    """The causal LM for the pipeline's prefill and decode entry points (they choose their own inputs,
    so --dim does not apply): on the meta device with the directory's checkpoint, whose tensors stream
    into the artifact, or read by transformers (weights in memory, in the checkpoint's dtype) with
    `weights_in_memory` or when transformers converts some tensor when loading.

    Raises:
      TpuExportError: a --dim was given.
    """
    _no_dims_for_generation(dims)
    encoder_decoder = bool(getattr(resolved.config, "is_encoder_decoder", False))
    # BART's model type is in both tables: its encoder-decoder configs generate as encoder-decoders, read
    # in memory (their entry points do not stream a checkpoint yet). Whisper's is in the causal LM table
    # (its decoder alone): its encoder-decoder is the speech seq2seq class.
    auto_class = auto_model_class(_encoder_decoder_class(resolved.config) if encoder_decoder else resolved.auto_class, resolved.config)
    weights_in_memory = weights_in_memory or encoder_decoder
    dtype = _config_dtype(resolved.config)
    checkpoint = None
    if not weights_in_memory:
        with parameters_on_meta():
            model = auto_class.from_config(resolved.config, dtype=dtype).eval()
        checkpoint = _checkpoint(resolved.directory, model)
    if checkpoint is None:
        _check_in_memory_fit(resolved, "an encoder-decoder's entry points do not stream them yet" if encoder_decoder else
                             "--quantize int8/int8-dynamic reads them in" if weights_in_memory else
                             "transformers converts some of its tensors as it loads them")
        model = _from_pretrained(auto_class, resolved.directory, dtype)
    traceable_experts(model)
    record = serving_record(resolved, type(model).__name__, resolved.config.model_type)
    return LoadedSource(model.eval(), None, None, None, _source_info(resolved), checkpoint=checkpoint, huggingface=record)


def _no_dims_for_generation(dims: list[DimSpec]) -> None:
    if dims:
        raise TpuExportError("--dim does not apply to --task text-generation (its entry points' sizes are --max-batch, "
                             "--max-context and the --bucket seq=... prompt lengths); drop it")


def _language_model_source(resolved: ResolvedModel, dims: list[DimSpec], weights_in_memory: bool) -> LoadedSource:
    """A multimodal model's language model as a causal LM for text generation (export/language_model.py):
    built from its text config on the meta device, its tensors streamed from the multimodal
    checkpoint under the causal LM's names, or copied from the multimodal model transformers reads
    (weights in memory, or tensors transformers converts when loading). The other towers are not
    converted: the artifact takes and gives text."""
    _no_dims_for_generation(dims)
    config, text_config = resolved.config, language_model_config(resolved.config)
    dtype = _config_dtype(config)
    with parameters_on_meta():
        model = auto_model_class("AutoModelForCausalLM", text_config).from_config(text_config, dtype=dtype).eval()
        multimodal = multimodal_model(config, dtype)
    multimodal_class = type(multimodal)
    names, siblings = language_model_names(multimodal, model), tied_names(multimodal)
    unknown = sorted(set(names.values()) - set(siblings))
    if unknown:
        raise TpuExportError(f"{type(multimodal).__name__}'s language model does not hold the tensors of {type(model).__name__} "
                             f"({', '.join(unknown[:3])}); convert one tower from a file.py:factory")
    checkpoint = None if weights_in_memory else _checkpoint(resolved.directory, multimodal)
    if checkpoint is not None:
        tensors = checkpoint._tensors  # the multimodal model's names -> the file's keys
        checkpoint = _Renamed(checkpoint._checkpoint, {
            name: next(tensors[sibling] for sibling in siblings[multimodal_name] if sibling in tensors)
            for name, multimodal_name in names.items()})
    else:
        _check_in_memory_fit(resolved, "--quantize int8/int8-dynamic reads them in" if weights_in_memory else
                             "transformers converts some of its tensors as it loads them")
        loaded = _from_pretrained(multimodal_class, resolved.directory, dtype).state_dict()  # tied tensors under each name
        model.load_state_dict({name: loaded[multimodal_name] for name, multimodal_name in names.items()}, strict=False, assign=True)
    traceable_experts(model)
    record = serving_record(resolved, type(model).__name__, config.model_type)
    return LoadedSource(model.eval(), None, None, None, _source_info(resolved), checkpoint=checkpoint, huggingface=record)


def _check_in_memory_fit(resolved: "ResolvedModel", why: str) -> None:
    """Refuses, before reading them, a directory's weights that are to be read into memory ({why})
    and alone exceed the conversion's memory budget."""
    check_weights_fit(stored_weight_bytes(resolved.directory), f"the weights of {resolved.directory} ({why})", resolved.memory_budget,
                      "give a larger --memory-budget, or convert it so that its weights stream from the directory (without "
                      "--quantize int8/int8-dynamic; a file.py:factory source streams them with --checkpoint)")


def _encoder_decoder_class(config) -> str:
    """The auto class of an encoder-decoder LM: the speech one for audio encoders (Whisper), else AutoModelForSeq2SeqLM."""
    from transformers.models.auto import modeling_auto

    speech = config.model_type in modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES
    return "AutoModelForSpeechSeq2Seq" if speech and config.model_type not in modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES \
        else "AutoModelForSeq2SeqLM"


def generation_context(model: torch.nn.Module) -> int:
    """The positions a causal LM's config allows (its `max_position_embeddings`, else GPT-2's
    `n_positions`, else an encoder-decoder's decoder `max_target_positions`; a multimodal model's
    from its text config): the default --max-context of a Hugging Face text-generation source. A
    config recording none belongs to a model without a table of positions to run out of (BLOOM's
    ALiBi, XLNet's and CPM-Ant's relative positions, Mamba's recurrent state): UNRECORDED_CONTEXT,
    as vLLM defaults them.

    Raises:
      TpuExportError: the entry points cannot generate with the model (export.generation.check_decoder).
    """
    check_decoder(model)  # a model the entry points cannot generate with is refused for that, not for its positions
    config = model.config
    positions = recorded_positions(config) or getattr(config, "max_target_positions", None)
    if not positions:
        return UNRECORDED_CONTEXT
    return min(int(positions), longest_positions(model, int(positions)))


# The default --max-context of a causal LM whose config records no positions (vLLM's default max_model_len then).
UNRECORDED_CONTEXT = 2048
# Config fields that record how many positions a model has, by family (BERT/Llama, GPT-2, ...).
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")


def recorded_positions(config) -> int | None:
    """The positions a config records (POSITION_FIELDS, in the model's own config or in its text
    config: a multimodal model's language model, a dual encoder's text tower), or None."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return next((int(value) for source in (config, text) for name in POSITION_FIELDS if isinstance(value := getattr(source, name, None), int)
                 and value > 0), None)


def longest_positions(model: torch.nn.Module, recorded: int) -> int:
    """The longest sequence a model's position tables take, given the length its config records.

    A learned position table with a padding index numbers positions from padding_idx + 1 (RoBERTa,
    XLM-RoBERTa, CamemBERT, MPNet, Longformer, ESM, ...): of its rows, padding_idx + 1 hold no
    position, so the model takes that many fewer than `max_position_embeddings` says. Such a table is
    any module named for positions with a padding index and a 2-D weight: `torch.nn.Embedding`, or
    a model's own embedding class (I-BERT's QuantEmbedding).
    """
    longest = recorded
    for name, module in model.named_modules():
        padding_idx, weight = getattr(module, "padding_idx", None), getattr(module, "weight", None)
        if "position" in name.rpartition(".")[2] and isinstance(padding_idx, int) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            longest = min(longest, weight.shape[0] - padding_idx - 1)
    return longest


def forward_program(model: torch.nn.Module, dims: list[DimSpec] = ()) -> tuple[torch.nn.Module, tuple, dict]:
    """A transformers model's forward as tpuexport converts it, with its example inputs and dims.

    Args:
      model: a transformers model (its weights on the meta device or not); its config's use_cache
        is turned off (the program is the forward over the whole input, no cache outputs).
      dims: --dim overrides of the dims' ranges.
    Returns:
      (the named_forward module, example args, torch.export dynamic_shapes by input name).
    Raises:
      TpuExportError: the model takes none of the known inputs, or a --dim names no dim of it.
    """
    config = model.config
    config.use_cache = False
    traceable_experts(model)
    grid = patch_grid(model)
    if grid is not None:
        return _grid_forward_program(model, grid, list(dims))
    inputs = model_inputs(model, config)
    text_max = longest_positions(model, recorded_positions(config) or DEFAULT_MAX_SEQUENCE)
    inputs = [dataclasses.replace(spec, high=text_max) if spec.name == "position_ids" else spec for spec in inputs]
    dim_ranges = _dims(inputs, config, list(dims), text_max)
    args, dynamic_shapes = _example_inputs(inputs, dim_ranges, _config_dtype(config))
    names = [spec.name for spec in inputs]
    constants = {}
    if placeholder_keys(config) and "input_ids" in names and set(names) & set(MEDIA_INPUTS):
        constants = _image_constants(model, names, dim_ranges, list(dims))
        def every_layout(inputs):  # the inputs as they are, then in their media's other layouts
            return [inputs, *_media_layouts(inputs, config)]

        candidates = _image_layouts(model, inputs, constants) if constants else every_layout(inputs)
        try:
            inputs, dim_ranges = _placeholders_counted(model, candidates, dim_ranges, list(dims), constants)
        except FeatureCountFromValues:
            if constants or "input_features_mask" not in names:
                raise
            inputs, constants = [spec for spec in inputs if spec.name != "input_features_mask"], _whole_audio(model, dim_ranges, list(dims))
            inputs, dim_ranges = _placeholders_counted(model, every_layout(inputs), dim_ranges, list(dims), constants)
        args, dynamic_shapes = _example_inputs(inputs, dim_ranges, _config_dtype(config))
    wrapped = named_forward(model, tuple(spec.name for spec in inputs), {spec.name: spec.placeholders for spec in inputs if spec.placeholders},
                            constants)
    other_layouts = _media_layouts(inputs, config)
    if other_layouts and not _runs_shape_only(wrapped, args):
        for other in other_layouts:
            other_args, other_shapes = _example_inputs(other, dim_ranges, _config_dtype(config))
            if _runs_shape_only(wrapped, other_args):
                args, dynamic_shapes = other_args, other_shapes
                break
    return wrapped, args, dynamic_shapes


def _grid_forward_program(model: torch.nn.Module, grid: PatchGrid, dims: list[DimSpec]) -> tuple[torch.nn.Module, tuple, dict]:
    """A vision tower over flattened patches (export/patch_grids.py) at one image size: its patches the
    one input, in the first layout it takes (a NaFlex tower's over the batch --dim gives), the grid a constant.

    Raises:
      TpuExportError: a --dim other than a fixed height or width, or a tower taking none of the layouts.
    """
    height, width = grid.image_size(model.config, dims)
    batch = {"batch": next((dim for dim in dims if dim.name == "batch"), DEFAULT_BATCH)}  # a NaFlex tower's images
    wrapped = named_forward(model, (grid.patches_input,), constants=grid.constants(height, width))
    dtype, failures = _config_dtype(model.config), []
    for layout in grid.layouts(height, width):
        args, dynamic_shapes = _example_inputs([ModelInput(grid.patches_input, layout, dtype)], batch, dtype)
        failures.append(failure_on(wrapped, args))
        if failures[-1] is None:
            return wrapped, args, dynamic_shapes
    raise TpuExportError(f"{type(model).__name__} ({model.config.model_type}) takes none of the patch layouts tpuexport makes for one "
                         f"{height}x{width} image ({', '.join(str(list(shape)) for shape in grid.layouts(height, width))}) with "
                         f"{grid.grid_input} {grid.grid(height, width)} (on the first: {failures[0]}); convert it from a file.py:factory")


def _image_constants(model: torch.nn.Module, names: list[str], dims: dict[str, DimSpec],
                     given: list[DimSpec]) -> dict[str, torch.Tensor | None]:
    """The inputs besides its pixels a multimodal model's image features require, for images of one
    fixed size: constants of the program (export/patch_grids.py), one image a row and one row a call.
    {"image_sizes": [[height, width]]} where they crop or tile by each image's size (Mistral 3's and
    LightOn OCR's Pixtral tower, LLaVA-NeXT's tiles; LLaVA's take it only for a Pixtral tower, which its
    config names); a NaFlex tower's spatial_shapes, and no patch mask (LFM2-VL's SigLIP 2); the image_grid_thw of a
    model whose image features take it (Qwen2-VL's, _takes_image_grid). {} for any other model.

    Raises:
      TpuExportError: --dim gives a batch other than one row.
    """
    features = features_method(model, "get_image_features")
    if features is None or "pixel_values" not in names:
        return {}
    parameters, forward = inspect.signature(features).parameters, inspect.signature(model.forward).parameters
    required = [name for name in IMAGE_CONSTANTS if name in parameters and name in forward and parameters[name].default is inspect.Parameter.empty]
    if _takes_image_grid(model):
        required = ["image_grid_thw"]
    if not required:
        return {}
    batch = next((dim for dim in given if dim.name == "batch"), None)
    if batch is not None and (batch.min, batch.max) != (1, 1):
        raise TpuExportError(f"--dim batch={batch.min}:{batch.max}: {type(model).__name__} ({model.config.model_type}) takes each image's "
                             f"size ({', '.join(required)}), which the program fixes for one image a call; give --dim batch=1:1 or leave batch out")
    height, width = dims["height"].min, dims["width"].min
    if required == ["image_grid_thw"]:  # whole merged patches, as its tower converts alone
        tower = _tower(model)
        grid = patch_grid(tower)
        height, width = grid.image_size(tower.config, [dim for dim in given if dim.name in ("height", "width")])
        return {"image_grid_thw": grid.constants(height, width)[grid.grid_input]}
    if "spatial_shapes" in required:
        return _naflex_grid(model.config).constants(height, width)
    return {"image_sizes": torch.tensor([[height, width]])}


def _tower(model: torch.nn.Module) -> torch.nn.Module:
    """The vision tower of a model taking its images' grid (_takes_image_grid): the first submodule
    over flattened patches and their grid (export/patch_grids.py).

    Raises:
      TpuExportError: no submodule is such a tower.
    """
    tower = next((module for module in model.modules() if module is not model and hasattr(module, "config")
                  and patch_grid(module) is not None), None)
    if tower is None:
        raise TpuExportError(f"{type(model).__name__} ({model.config.model_type}) takes image_grid_thw but none of its modules is a "
                             "vision tower over flattened patches and their grid; convert its language model alone with --task text-generation")
    return tower


def _naflex_grid(config) -> PatchGrid:
    """A multimodal model's NaFlex tower (LFM2-VL's SigLIP 2): a batch of flattened images and their
    spatial shapes (export/patch_grids.py)."""
    return PatchGrid("pixel_values", "spatial_shapes", int(_setting(config, "patch_size", "vision_config")), 1,
                     int(_setting(config, "num_channels", "vision_config") or 3), 1, mask_input="pixel_attention_mask")


def _placeholders_counted(model: torch.nn.Module, candidates: list[list[ModelInput]], dims: dict[str, DimSpec], given: list[DimSpec],
                          constants: dict[str, torch.Tensor | None]) -> tuple[list[ModelInput], dict[str, DimSpec]]:
    """_with_placeholders of the first of the candidate inputs (the layouts its images may take,
    _image_layouts) whose placeholders the model counts.

    Raises:
      TpuExportError: as _with_placeholders, on the first candidate, when none is counted.
    """
    failures = []
    for inputs in candidates:
        args, _ = _example_inputs(inputs, dims, _config_dtype(model.config))
        try:
            return _with_placeholders(model, inputs, dims, given, args, constants)
        except TpuExportError as error:
            failures.append(error)
    raise next((error for error in failures if isinstance(error, FeatureCountFromValues)), failures[0])  # past the layout's mismatch


def _whole_audio(model: torch.nn.Module, dims: dict[str, DimSpec], given: list[DimSpec]) -> dict[str, torch.Tensor]:
    """{"input_features_mask": every frame}, a constant of the program, for an audio model whose
    features number as many as its mask's valid frames (Audio Flamingo 3's, GLM-ASR's: the count
    comes from the mask's values, which one program cannot follow). Its audio then fills all of the fixed frames, as Whisper's does: a shorter clip is padded
    with its feature extractor's padding value and counted whole.

    Raises:
      TpuExportError: --dim gives a batch other than one row (the mask is one row's).
    """
    batch = next((dim for dim in given if dim.name == "batch"), None)
    if batch is not None and (batch.min, batch.max) != (1, 1):
        raise TpuExportError(f"--dim batch={batch.min}:{batch.max}: {type(model).__name__} ({model.config.model_type}) counts its audio "
                             "features from its input_features_mask's values, which the program fixes to one row of whole clips; give "
                             "--dim batch=1:1 or leave batch out")
    return {"input_features_mask": torch.ones(1, dims["frames"].min, dtype=torch.long)}


def _image_layouts(model: torch.nn.Module, inputs: list[ModelInput], constants: dict[str, torch.Tensor | None]) -> list[list[ModelInput]]:
    """The inputs of a multimodal model whose image constants (_image_constants) set its images'
    layout. A NaFlex tower's images are [batch, patches, channels x patch x patch]. Images tiled at any
    resolution (LLaVA-NeXT, LLaVA-NeXT-Video, LLaVA-OneVision, Granite 4 Vision: a config listing
    image_grid_pinpoints) are [batch, tiles, channels, tile, tile]: an image of the fixed image_sizes is
    resized to the best of the pinpoints and cut into tiles of the vision tower's size, beside a base
    tile of the whole image; how many, the model's own module counts (its image_size_to_num_patches). A
    video's frames (LLaVA-NeXT-Video's, LLaVA-OneVision's) are the tower's size too. A model taking its
    images' grid takes one image's patches in one of the layouts its tower may take (PatchGrid.layouts).
    Other models' inputs as they are. Returns: the candidate inputs, in the order to try them."""
    config = model.config
    if "image_grid_thw" in constants:
        grid, (_, rows, columns) = patch_grid(_tower(model)), constants["image_grid_thw"][0].tolist()
        return [[dataclasses.replace(spec, axes=layout) if spec.name == "pixel_values" else spec for spec in inputs]
                for layout in grid.layouts(rows * grid.patch, columns * grid.patch)]
    if "spatial_shapes" in constants:
        patches, grid = int(constants["spatial_shapes"][0].prod()), _naflex_grid(config)
        layouts = {"pixel_values": lambda axes: (axes[0], patches, grid.channels * grid.patch * grid.patch)}
    else:
        pinpoints = getattr(config, "image_grid_pinpoints", None)
        count_tiles = getattr(sys.modules[type(model).__module__], "image_size_to_num_patches", None)
        if not pinpoints or count_tiles is None:
            return [inputs]
        tile = _setting(config, "image_size", "vision_config")
        tiles = count_tiles(image_size=constants["image_sizes"][0].tolist(), grid_pinpoints=pinpoints, patch_size=tile)
        layouts = {"pixel_values": lambda axes: (axes[0], tiles, axes[1], tile, tile), "pixel_values_videos": lambda axes: (*axes[:-2], tile, tile)}
    return [[dataclasses.replace(spec, axes=layouts[spec.name](spec.axes)) if spec.name in layouts else spec for spec in inputs]]


def _with_placeholders(model: torch.nn.Module, inputs: list[ModelInput], dims: dict[str, DimSpec], given: list[DimSpec],
                       args: tuple, constants: dict[str, torch.Tensor]) -> tuple[list[ModelInput], dict[str, DimSpec]]:
    """A multimodal model's inputs with the placeholder tokens its token ids hold (export/placeholders.py),
    and its dims: seq long enough for them, and one row a call unless --dim gives batch (most such models
    list their media's features per item, which fixes the batch torch.export traced at). `constants`:
    inputs the program fixes (_image_constants), which its features method is given too.

    Raises:
      TpuExportError: the placeholders cannot be counted, or --dim seq leaves no room for them.
    """
    placeholders = count_placeholders(model, {spec.name: _one_row(spec, arg) for spec, arg in zip(inputs, args)}, constants)
    if not placeholders:
        return inputs, dims
    needed = 1 + sum(placeholder.count for placeholder in placeholders)
    seq = dims["seq"]
    if any(spec.name == "seq" for spec in given) and seq.min < needed:
        raise TpuExportError(f"--dim seq={seq.min}:{seq.max}: the model's token ids hold {needed - 1} placeholder tokens a row "
                             f"(where its media's features go) and a text token; give --dim seq={needed}:{max(seq.max, needed)}")
    if seq.max < needed:
        raise TpuExportError(f"{type(model).__name__} ({model.config.model_type}) takes at most {seq.max} tokens but one "
                             f"row holds {needed - 1} placeholder tokens for its media's features; no sequence fits"
                             + ("; give smaller images (--dim height=H:H --dim width=W:W)" if "height" in dims else ""))
    dims = {**dims, "seq": DimSpec("seq", max(seq.min, needed), seq.max)}
    if not any(spec.name == "batch" for spec in given):
        dims["batch"] = DimSpec("batch", 1, 1)
    inputs = [dataclasses.replace(spec, placeholders=placeholders) if spec.name == "input_ids" else spec for spec in inputs]
    return inputs, dims


def _one_row(spec: ModelInput, example: torch.Tensor) -> torch.Tensor:
    """The first row of an example along its batch axis (all of an input without one: one image's patches)."""
    return example.narrow(spec.axes.index("batch"), 0, 1) if "batch" in spec.axes else example


def _takes_image_grid(model: torch.nn.Module) -> bool:
    """Whether the model's image features take each image's grid of patches (image_grid_thw: Qwen2-VL's
    and its descendants', Kimi K2.5's, ...), which the program fixes for one image (_image_constants)."""
    features = features_method(model, "get_image_features")
    return (features is not None and "image_grid_thw" in inspect.signature(features).parameters
            and "image_grid_thw" in inspect.signature(model.forward).parameters)


def _grid_positions(model: torch.nn.Module) -> bool:
    """Whether the model numbers its tokens' rotary positions over its images' grid (Qwen2-VL's
    multimodal RoPE and its descendants': `get_rope_index`, a frame, row and column per token). It
    computes them from the token ids' values in Python loops, which one exported program cannot
    hold: the program takes them as `position_ids` [3, batch, seq], computed by the caller, as vLLM
    computes them on the host (transformers: the model's own `get_rope_index`)."""
    return (_takes_image_grid(model) and callable(getattr(model, "get_rope_index", None))
            and "position_ids" in inspect.signature(model.forward).parameters)


def _other_layouts(spec: ModelInput, config) -> tuple[ModelInput, ...]:
    """The other ways some models lay out an input, tried in order when the first does not run: mel
    features time-major, [batch, frames, mel bins] (Parakeet and the other FastConformer encoders);
    waveforms with a channel axis, [batch, 1, samples] (PE-Audio's and DAC's encoders, whose configs record no
    audio_channels: _audio_channels), or
    input_values that are a spectrogram, [batch, frames, mel bins] at the frames its config records
    (the Audio Spectrogram Transformer's max_length, 1024), or waveforms of whole tokens (_whole_tokens); a clip of the frames a video model's config
    records, [batch, frames, channels, height, width] (VideoMAE, ViViT, V-JEPA 2, ...); none for other inputs."""
    if spec.name == "pixel_values":
        video = isinstance(_setting(config, "num_frames", "vision_config") or _setting(config, "frames_per_clip", "vision_config"), int)
        return (dataclasses.replace(spec, axes=(spec.axes[0], _video_frames(config), *spec.axes[1:])),) if video else ()
    if spec.name == "input_features":
        return (dataclasses.replace(spec, axes=(spec.axes[0], spec.axes[2], spec.axes[1])),)
    if spec.name == "input_values" and len(spec.axes) == 2:
        channels = dataclasses.replace(spec, axes=(spec.axes[0], 1, spec.axes[1]))  # mono: a config recording channels has its axis already
        mel_bins, frames = _setting(config, "num_mel_bins", "audio_config"), _setting(config, "max_length", "audio_config")
        whole_tokens = _whole_tokens(spec, config)
        if not isinstance(mel_bins, int):
            return (channels, *whole_tokens)
        spectrogram = (spec.axes[0], frames if isinstance(frames, int) else DEFAULT_MEL_FRAMES, mel_bins)
        return channels, dataclasses.replace(spec, axes=spectrogram), *whole_tokens
    return ()


def _whole_tokens(spec: ModelInput, config) -> tuple[ModelInput, ...]:
    """Waveforms of whole tokens, where the config records the samples a token takes and the default
    length is not a multiple (MuseSpark's audio tokenizer: 1920 samples a token, 16000 rounded up to 17280),
    as its feature extractor pads them; () otherwise."""
    hop = _setting(config, "samples_per_token", "audio_config")
    if not isinstance(hop, int) or isinstance(hop, bool) or hop <= 0 or DEFAULT_AUDIO_SAMPLES % hop == 0:
        return ()
    return (dataclasses.replace(spec, axes=(spec.axes[0], -(-DEFAULT_AUDIO_SAMPLES // hop) * hop)),)


def _media_layouts(inputs: list[ModelInput], config) -> list[list[ModelInput]]:
    """The inputs with their media in each of the other layouts they may take (_other_layouts), the
    first of each, then the second, ...: the candidates a multimodal model's features method counts its
    placeholders over when it does not take the first (Granite Speech's and FunASR's time-major mel features)."""
    layouts = [_other_layouts(spec, config) if spec.name in MEDIA_INPUTS else () for spec in inputs]
    return [[spec_layouts[index] if index < len(spec_layouts) else spec for spec, spec_layouts in zip(inputs, layouts)]
            for index in range(max(map(len, layouts), default=0))]


def _runs_shape_only(forward: torch.nn.Module, args: tuple) -> bool:
    """Whether the forward runs on these inputs, computed on shapes alone (on the meta device with
    weights there, else with fake tensors): how an audio or video model lays out its input
    (`_other_layout`) is known by which layout it takes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    on_meta = any(parameter.is_meta for parameter in forward.parameters())
    if on_meta:  # the buffers its init computed too (they stay real beside meta parameters)
        forward, args = meta_copy(forward), tuple(arg.to("meta") for arg in args)
    try:  # fake tensors over meta ones too: they read a constant's value (`.item()` of a tensor the forward makes), meta cannot
        # Fake tensors log the traceback of an operator that fails on them: a failure here is an answer, not news.
        with torch.no_grad(), quiet_loggers(*EXPORT_LOGGERS, level=logging.CRITICAL), FakeTensorMode(allow_non_fake_inputs=True), \
                constants_read() if getattr(forward, "constants", None) else contextlib.nullcontext():
            forward(*args)
    except Exception:  # whatever the model raises on inputs it does not take
        return False
    return True


def traceable_experts(model: torch.nn.Module) -> None:
    """Switches a mixture-of-experts model that defaults to transformers' "eager" experts (a Python
    loop over the experts some token chose: data-dependent, so torch.export cannot trace it; the
    OpenAI privacy filter's) to the same experts as one grouped matmul, which it can."""
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if can_set is not None and can_set() and getattr(model.config, "_experts_implementation", None) == "eager":
        model.set_experts_implementation("grouped_mm")


def _config_dtype(config) -> torch.dtype:
    """The checkpoint's dtype as the config records it (float32 when it records none)."""
    recorded = getattr(config, "dtype", None)
    if isinstance(recorded, str):
        recorded = getattr(torch, recorded, None)
    return recorded if isinstance(recorded, torch.dtype) and recorded.is_floating_point else torch.float32


def model_inputs(model: torch.nn.Module, config) -> list[ModelInput]:
    """The inputs a model of this family takes, in its forward's order.

    Args:
      model: the transformers model.
      config: its config.
    Returns:
      The ModelInputs: token inputs for text models (attention_mask beside input_ids,
      token_type_ids where the config has more than one type), decoder_input_ids for
      encoder-decoders, pixel_values, pixel_values_videos, input_values or input_features for
      vision, video and audio (with input_features_mask where the forward takes one), and the
      rotary positions of a model numbering them over its image grid (_grid_positions).
    Raises:
      TpuExportError: the forward takes none of these, or requires another input (grid sizes, prompts,
        position ids) that tpuexport does not make.
    """
    signature = inspect.signature(model.forward).parameters
    parameters = list(signature)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    decoder_vocab = int(getattr(getattr(config, "get_text_config", lambda **_: config)(decoder=True), "vocab_size", vocab) or vocab)
    candidates = {
        "input_ids": ModelInput("input_ids", ("batch", "seq"), torch.long, vocab),
        "attention_mask": ModelInput("attention_mask", ("batch", "seq"), torch.long, 2),
        "token_type_ids": ModelInput("token_type_ids", ("batch", "seq"), torch.long, int(getattr(config, "type_vocab_size", 0) or 0)),
        "pixel_values": ModelInput("pixel_values", ("batch", _channels(config), "height", "width"), torch.float32),
        "pixel_values_videos": ModelInput("pixel_values_videos", ("batch", _video_frames(config), _channels(config), "height", "width"),
                                          torch.float32),
        "input_values": ModelInput("input_values", ("batch", *_audio_channels(config), "samples"), torch.float32),
        "input_features": ModelInput("input_features", ("batch", _feature_width(config), "frames"), torch.float32),
        # A time series' last context_length values per channel (PatchTST, PatchTSMixer), as their configs fix them.
        # TimesFM's configs record no channels: not made for it (its 2.5's verification at its 16384 values took
        # 24 GB at batch 1 and was OOM-killed: left refused as taking none of these inputs).
        **({"past_values": ModelInput("past_values", ("batch", *_series_axes(config)), torch.float32)}
           if isinstance(getattr(config, "num_input_channels", None), int) else {}),
        # Which mel frames are audio (1) and which padding (0); some audio encoders read it unconditionally.
        "input_features_mask": ModelInput("input_features_mask", ("batch", "frames"), torch.long, 2),
        "decoder_input_ids": ModelInput("decoder_input_ids", ("batch", "decoder_seq"), torch.long, decoder_vocab),
        # Each token's (frame, row, column) rotary positions, which the caller computes (_grid_positions).
        "position_ids": ModelInput("position_ids", (3, "batch", "seq"), torch.long),
    }
    both_audio = ("input_values", "input_features") if {"input_values", "input_features"} <= set(parameters) else ()
    audio_input = getattr(getattr(model, "encoder", None), "main_input_name", None)
    chosen = []
    for name in parameters:
        if name not in candidates:
            continue
        if name == "attention_mask" and "input_ids" not in parameters:
            continue  # audio and vision models' masks are for padding their own way; not an input here
        if name == "input_features_mask" and ("input_features" not in parameters or _mask_not_for_features(model, signature[name])):
            continue
        if name == "token_type_ids" and candidates[name].high < 2:
            continue
        if name == "decoder_input_ids" and not getattr(config, "is_encoder_decoder", False):
            continue
        if name == "position_ids" and not _grid_positions(model):
            continue
        if name == "pixel_values_videos" and _takes_image_grid(model):
            continue  # the images' one grid is the program's: a video's patches would need their own
        if name in both_audio and audio_input in both_audio and name != audio_input:
            continue  # a speech encoder-decoder's forward takes either, for whichever its encoder reads: only that one
        chosen.append(candidates[name])
    if not any(spec.name in ("input_ids", *MEDIA_INPUTS) for spec in chosen):
        known = [name for name in ("input_ids", *MEDIA_INPUTS) if name in candidates]  # past_values only where the config has channels
        raise TpuExportError(f"{type(model).__name__} takes none of {', '.join(known)}; write a file.py:factory for it")
    made = [spec.name for spec in chosen]
    required = [name for name, parameter in signature.items() if parameter.default is inspect.Parameter.empty and name not in made
                and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if required:  # refused here, before any forward runs: called without them, it fails with Python's "missing ... argument"
        raise TpuExportError(
            f"{type(model).__name__} ({getattr(config, 'model_type', '?')}) requires {', '.join(required)} in its forward, which "
            f"tpuexport does not make from a directory (it makes {', '.join(made)}); convert it from a file.py:factory whose "
            "module gives them (as buffers or from its own inputs) and whose example args are the others")
    return chosen


def _mask_not_for_features(model: torch.nn.Module, parameter: inspect.Parameter) -> bool:
    """Whether a multimodal model's optional input_features_mask is not its audio frames' mask: its
    get_audio_features does not take it (Granite Speech's selects rows of its projected features, a
    count from values); an encoder's own, even optional, is (AudioFlamingo3's encoder sums it)."""
    features = features_method(model, "get_audio_features")
    return (parameter.default is not inspect.Parameter.empty and features is not None
            and "input_features_mask" not in inspect.signature(features).parameters)


def _setting(config, name: str, *towers: str):
    """A config field, or the field of the first named sub-config that has it (a dual encoder's
    vision_config or audio_config, Parakeet's encoder_config) when the model's own config has none."""
    value = getattr(config, name, None)
    for tower in towers:
        value = value if value is not None else getattr(getattr(config, tower, None), name, None)
    return value


def _video_frames(config) -> int:
    """The frames of a clip as a video model's config records them (num_frames, V-JEPA 2's frames_per_clip)."""
    frames = _setting(config, "num_frames", "vision_config") or _setting(config, "frames_per_clip", "vision_config")
    return int(frames) if isinstance(frames, int) else DEFAULT_VIDEO_FRAMES


def _feature_width(config) -> int:
    """The features a frame of input_features has: the config's mel bins (Whisper's 80 or 128), else
    the width the model's feature projection takes (wav2vec2-BERT's feature_projection_input_dim, 160:
    80 mel bins stacked 2 frames at a time by its feature extractor; NeuCodec's and XCodec2's semantic
    encoder is one), else 80. The mel bins are looked for in the sub-configs too, breadth first (the
    Nemotron speech LM's ASR encoder's, two levels down); FunASR's encoder stacks num_stacked_frames of
    them a frame, as its feature extractor does (low frame rate features)."""
    owner = next((sub for sub in _sub_configs(config) if isinstance(getattr(sub, "num_mel_bins", None), int)), None)
    if owner is not None:
        return int(owner.num_mel_bins) * int(getattr(owner, "num_stacked_frames", 1) or 1)
    width = _setting(config, "feature_projection_input_dim", "semantic_model_config")
    return int(width) if isinstance(width, int) and not isinstance(width, bool) else 80


def _sub_configs(config):
    """The config and its sub-configs (its `sub_configs`' fields), breadth first."""
    queue = [config]
    while queue:
        config = queue.pop(0)
        yield config
        queue.extend(sub for name in getattr(config, "sub_configs", {}) if (sub := getattr(config, name, None)) is not None
                     and hasattr(sub, "sub_configs"))


def _audio_channels(config) -> tuple[int, ...]:
    """The channel axis of a waveform, (channels,), when the config records the channels its model
    convolves (audio_channels: EnCodec's, Mimi's, Pocket TTS's audio tokenizer, which check the
    waveform's dim 1 against it, as their feature extractors write [batch, channels, samples]); ()
    otherwise (wav2vec2-style encoders take [batch, samples]; _other_layouts tries a channel axis
    when that does not run)."""
    channels = _setting(config, "audio_channels", "audio_config")
    return (channels,) if isinstance(channels, int) and not isinstance(channels, bool) and channels > 0 else ()


def _series_axes(config) -> tuple[int, int]:
    """A time series' axes after the batch: the context length and the channels its config records."""
    return int(getattr(config, "context_length", 0) or 512), int(config.num_input_channels)


def _channels(config) -> int:
    return int(_setting(config, "num_channels", "vision_config") or 3)


def _image_size(value) -> tuple[int, int]:
    """(height, width) of an image_size or crop_size: one number or [height, width]."""
    if isinstance(value, (list, tuple)):
        return int(value[0]), int(value[-1])
    return int(value), int(value)


def _dims(inputs: list[ModelInput], config, overrides: list[DimSpec], text_max: int) -> dict[str, DimSpec]:
    """The named dims the inputs use, with ranges from the config (`text_max`: the longest token
    sequence the model takes), then the --dim overrides.

    Raises:
      TpuExportError: a --dim names a dim the inputs do not use.
    """
    used = [axis for spec in inputs for axis in spec.axes if isinstance(axis, str)]
    decoder_max = int(getattr(config, "max_target_positions", 0) or text_max)
    # [height, width] where the config records two (MGP-STR's 32 x 128 text crops, YOLOS's 512 x 864), one size otherwise
    height, width = _image_size(_setting(config, "image_size", "vision_config") or _setting(config, "crop_size", "vision_config")
                                or DEFAULT_IMAGE_SIZE)
    frames = 2 * int(_setting(config, "max_source_positions", "audio_config", "encoder_config") or 0) or DEFAULT_MEL_FRAMES
    defaults = {
        "batch": DEFAULT_BATCH,
        "seq": DimSpec("seq", 2, text_max),
        "decoder_seq": DimSpec("decoder_seq", 2, decoder_max),
        "height": DimSpec("height", height, height),
        "width": DimSpec("width", width, width),
        "samples": DimSpec("samples", DEFAULT_AUDIO_SAMPLES, DEFAULT_AUDIO_SAMPLES),
        "frames": DimSpec("frames", frames, frames),
    }
    dims = {name: defaults[name] for name in dict.fromkeys(used)}
    for override in overrides:
        if override.name not in dims:
            raise TpuExportError(f"--dim {override.name} is not a dim of this model; its dims are {', '.join(dims)}")
        dims[override.name] = override
    return dims


def _example_inputs(inputs: list[ModelInput], dims: dict[str, DimSpec], dtype: torch.dtype):
    """Seeded example tensors and torch.export dynamic_shapes (by input name).

    Float inputs take the model's dtype; the attention mask pads the last sequence's tail, so that
    verification covers masking.
    """
    torch_dims = {name: torch.export.Dim(name, min=spec.min, max=spec.max) for name, spec in dims.items() if spec.min < spec.max}
    sizes = {name: min(max(EXAMPLE_SIZES.get(name, spec.min), spec.example), spec.max) for name, spec in dims.items()}
    generator = torch.Generator().manual_seed(0)
    args, dynamic_shapes = [], {}
    for spec in inputs:
        shape = [sizes[axis] if isinstance(axis, str) else axis for axis in spec.axes]
        if spec.name == "attention_mask":
            tensor = torch.ones(shape, dtype=spec.dtype)
            tensor[-1, shape[1] // 2 + 1:] = 0
        elif spec.name == "input_features_mask":  # every frame audio: the frames are a fixed size, padding is the caller's
            tensor = torch.ones(shape, dtype=spec.dtype)
        elif spec.dtype.is_floating_point:
            tensor = torch.randn(shape, generator=generator).to(dtype)
        else:
            tensor = torch.randint(0, max(spec.high, 1), shape, generator=generator, dtype=spec.dtype)
            if spec.placeholders:
                tensor = with_placeholders(tensor, spec.placeholders, max(spec.high, 1))
        args.append(tensor)
        dynamic_shapes[spec.name] = {axis: torch_dims[name] for axis, name in enumerate(spec.axes) if name in torch_dims} or None
    return tuple(args), dynamic_shapes


class _NamedForward(torch.nn.Module):
    """Calls a transformers model with its inputs by name and returns its output's tensors as a dict
    (logits, last_hidden_state, pooler_output, ...): the artifact's output names."""

    def __init__(self, model: torch.nn.Module, input_names: tuple[str, ...], placeholders: dict[str, tuple[Placeholder, ...]],
                 constants: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.model = model.eval()
        self.input_names = input_names
        self.placeholders = placeholders  # LoadedSource.placeholders
        # Inputs the program fixes (a vision tower's image grid, export/patch_grids.py): tensors made in the
        # forward from these numbers, whose values torch.export reads while tracing (patch_grids.constants_read).
        self.constants = dict(constants or {})
        # Asked per call, not only through model.config: encoder-decoders (T5) give their decoder a
        # copy of the config, whose use_cache would otherwise keep building a cache in the forward.
        self.options = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}

    def forward(self, *inputs):
        with attention_masks_applied():
            output = self.model(**dict(zip(self.input_names, inputs)), **made_from_numbers(self.constants), **self.options, return_dict=True)
        tensors = {name: value for name, value in output.items() if isinstance(value, torch.Tensor)}
        if self.constants:  # a vision tower's features per layer too (Qwen3-VL's deepstack features, which its language model adds)
            tensors.update({f"{name}_{index}": item for name, value in output.items() if isinstance(value, (list, tuple))
                            for index, item in enumerate(value) if isinstance(item, torch.Tensor)})
        return tensors


@contextlib.contextmanager
def attention_masks_applied():
    """Runs transformers models with their causal attention masks always built, as torch.export
    builds them.

    Eagerly, transformers' SDPA path drops a causal mask whose padding mask is all ones and lets the
    attention module's `is_causal` flag stand in for it (`masking_utils._ignore_causal_mask_sdpa`,
    meant to change no result). Under torch.export it never drops it (the decision reads the mask's
    values). Where a model's attention hard-codes `is_causal=False` beside a causal mask (AIMv2's
    text tower in transformers 5.24), the dropped mask turns an unpadded batch bidirectional: a
    row's output then depends on whether another row of its batch is padded, and the eager
    reference departs from the program (relative RMS 0.43 at batch 1 x seq 2). With the mask always
    built every row sees the causal mask it is given, as the program and transformers' "eager"
    attention compute; for every other model the result is unchanged.
    """
    from transformers import masking_utils

    dropped = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if dropped is None:
        yield
        return
    masking_utils._ignore_causal_mask_sdpa = lambda *args, **kwargs: False
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = dropped


def named_forward(model: torch.nn.Module, input_names: tuple[str, ...],
                  placeholders: dict[str, tuple[Placeholder, ...]] | None = None,
                  constants: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """A module whose forward takes `input_names` positionally (so torch.export and the artifact
    name the inputs as the family does) and returns the model's output tensors by field name.

    Args:
      model: a transformers model.
      input_names: its inputs, in the order the artifact takes them.
      placeholders: a multimodal model's placeholder tokens by token input (its `placeholders`).
      constants: inputs the program fixes, by name (a vision tower's grid), made in its forward from their values.
    Returns:
      The wrapping module (the model is its `model` submodule).
    """
    parameters = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ("self", *input_names)]

    def forward(self, *inputs):
        return _NamedForward.forward(self, *inputs)

    forward.__signature__ = inspect.Signature(parameters)
    named = type(type(model).__name__ + "Forward", (_NamedForward,), {"forward": forward})
    return named(model, input_names, placeholders or {}, constants)


def forward_without_cache(model, positional: int):
    """A transformers model handed to `tpuexport.convert` with example args, called as a directory's
    model is (named_forward: its first `positional` forward arguments by name, no cache built, its
    output tensors by field name): its own forward returns a cache object torch.export cannot
    output. Any other model is returned as it is."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return model
    return named_forward(model, tuple(list(inspect.signature(model.forward).parameters)[:positional]))


class _Renamed(Checkpoint):
    """The checkpoint's tensors under the wrapped model's names."""

    def __init__(self, checkpoint: Checkpoint, names: dict[str, str]):
        super().__init__(names, checkpoint.description, checkpoint.name)
        self._checkpoint = checkpoint

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._checkpoint[self._tensors[name]]

    def release(self) -> None:
        self._checkpoint.release()


def _checkpoint(directory: pathlib.Path, model: torch.nn.Module, prefix: str = "") -> Checkpoint | None:
    """The directory's checkpoint under the model's names, renamed as transformers renames them when
    loading (older layouts, base-model prefixes added or dropped).

    Args:
      directory: the model directory.
      model: the transformers model (its parameters on the meta device).
      prefix: where the converted module holds `model` ("model." for the named forward wrapper).
    Returns:
      The renamed Checkpoint; None when transformers would convert some tensor rather than rename
      it (e.g. per-expert weights fused into one tensor), or when some parameter (every name of a
      tied one) is not in it.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    if not any(directory.glob("*.safetensors")) and (directory / "pytorch_model.bin").is_file():
        checkpoint = open_checkpoint(directory / "pytorch_model.bin")
    else:
        checkpoint = open_checkpoint(directory)
    transforms = get_model_conversion_mapping(model)
    renamings = [transform for transform in transforms if not isinstance(transform, WeightConverter)]
    converters = [transform for transform in transforms if isinstance(transform, WeightConverter)]
    state = model.state_dict()
    names: dict[str, str] = {}
    for key in checkpoint:
        renamed, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if converted is not None:
            return None
        if renamed in state:
            names[prefix + renamed] = key
    if any(not any(prefix + name in names for name in group) for group in tied_names(model).values()):
        return None
    return _Renamed(checkpoint, names)


def _from_pretrained(auto_class, directory: pathlib.Path, dtype: torch.dtype) -> torch.nn.Module:
    """The model read by transformers itself (in memory), refusing weights it would initialize at random."""
    from transformers.utils import logging as transformers_logging

    progress_bar = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        with _offline():
            model, loading = auto_class.from_pretrained(str(directory), dtype=dtype, local_files_only=True, output_loading_info=True)
    finally:
        if progress_bar:
            transformers_logging.enable_progress_bar()
    if loading.get("missing_keys"):
        missing = sorted(loading["missing_keys"])
        raise TpuExportError(f"{directory} has no weights for {len(missing)} of the model's tensors ({', '.join(missing[:5])}); "
                             "give the checkpoint of this task's model (or --task feature-extraction for a base model)")
    return model.eval()


def _source_info(resolved: ResolvedModel) -> SourceInfo:
    """Provenance: the reference (without directories), and a sha256 over config.json and the
    weight files (by name and content)."""
    digest = hashlib.sha256()
    weight_files = sorted(path for pattern in ("*.safetensors", "*.safetensors.index.json", "pytorch_model.bin")
                          for path in resolved.directory.glob(pattern))
    for path in [resolved.directory / "config.json", *weight_files]:
        digest.update(f"{path.name}\0{file_sha256(path)}\n".encode())
    name = resolved.reference if resolved.reference.startswith(HF_PREFIX) else resolved.directory.resolve().name
    return SourceInfo("huggingface", name, digest.hexdigest(), f"{name} --task {resolved.task}", name)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
