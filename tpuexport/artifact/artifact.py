"""`Artifact`: an artifact directory opened for inspection and CPU runs.

What `load` and `run` read is checked first: every path the manifest names must stay inside the
artifact directory (relative, no "..", no symlink out of it), and each file run reads (program,
weights, golden data) must match its sha256 in the manifest before any of its bytes reach XLA's
parsers or any output is produced. Each file is hashed once per opened Artifact, when it is first
read: the weights (memory-mapped, not read by loading them) cost one sequential read of the file on
the first `run` (300 MiB/s here: benchmarks/studies/load_integrity.py; docs/robustness.md).
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import posixpath
import sys
from typing import Iterator

import jax
import numpy as np

from tpuexport.artifact.weights import map_weights
from tpuexport.artifact import layout
from tpuexport.artifact.manifest import sha256_file
from tpuexport.artifact.records import Manifest
from tpuexport.artifact.upgrade import upgraded
from tpuexport.devices import on_host_cpu, runs_on_host_cpu, steps_on_host_cpu
from tpuexport.errors import TpuExportError
from tpuexport.export.serving_files import is_tokenizer_file
from tpuexport.lower.lowered import LoweredProgram
from tpuexport.lower.programs import generation_program
from tpuexport.lower.program import DEFAULT_ENTRY_POINT
from tpuexport.lower.sampling import GREEDY, Sampling
from tpuexport.lower.seq2seq import FEATURES_USAGE, source_rows
from tpuexport.signature import ProgramSignature


# What every reader of an artifact (run, inspect, verify, the runtime) relies on, checked once by `load`.
REQUIRED_MANIFEST_ENTRIES = {
    "versions": dict,
    "precision": str,
    "matmul_precision": str,
    "program": dict,
    "program.weight_names": list,
    "entry_points": dict,
    "targets": dict,
    "verification": dict,
    "files": dict,
}
# What each entry point has.
REQUIRED_ENTRY_POINT_ENTRIES = {"exported": str, "signature": dict, "matmul_flops": str}
# What a converted (verified) artifact has beyond that; a plan has no weights and no golden data.
VERIFIED_MANIFEST_ENTRIES = {
    "program.weights": str,
    "verification.tolerances": dict,
    "verification.golden": str,
    "verification.cases": list,
}


class Artifact:
    """A converted model on disk.

    Attributes:
      path: the artifact directory.
      manifest: the parsed manifest.json.
    """

    def __init__(self, path: pathlib.Path, manifest: dict):
        self.path = path
        self.manifest = manifest

    def __repr__(self) -> str:
        return f"Artifact({str(self.path)!r}, targets={list(self.manifest['targets'])}{', plan only' if self.plan_only else ''})"

    @property
    def plan_only(self) -> bool:
        """True for a plan: compiled from the weights' shapes, with no weights, never verified."""
        return bool(self.manifest.get("plan_only", False))

    @property
    def task(self) -> str:
        """The task that made the entry points ("forward", "text-generation"; tpuexport/tasks)."""
        return self.records.task

    @functools.cached_property
    def records(self) -> Manifest:
        """The manifest as typed records (artifact/records.py)."""
        return Manifest.from_json(self.manifest)

    @functools.cached_property
    def entry_points(self) -> dict[str, LoweredProgram]:
        """Every entry point's program over the one set of weights, read back from the artifact (a
        plan's have no weights: they recompile but do not run)."""
        records = self.records
        return {name: LoweredProgram(jax.export.deserialize(bytearray(self.read_checked(entry.exported))), records.program.names,
                                     self._weights, entry.signature, records.precision, records.matmul_precision, entry.matmul_flops,
                                     scanned=tuple(self.manifest.get("scanned", ())), tied=records.program.tied,
                                     weight_layouts=records.program.layouts, decision_matmuls=entry.decision_matmuls)
                for name, entry in records.entry_points.items()}

    def entry_point(self, name: str = DEFAULT_ENTRY_POINT) -> LoweredProgram:
        """One entry point's program (the default one, "serving_default", is a forward model's).

        Raises:
          TpuExportError: the artifact has no entry point of that name.
        """
        if name not in self.records.entry_points:
            raise TpuExportError(f"{self.path} has no entry point {name!r}; it has {', '.join(self.records.entry_points)}"
                                 + ("; use Artifact.generate or Artifact.generation_program" if "generation" in self.manifest else ""))
        return self.entry_points[name]

    @property
    def signature(self) -> ProgramSignature:
        """The default entry point's signature (a forward model's inputs, outputs and dims)."""
        if DEFAULT_ENTRY_POINT not in self.records.entry_points:
            self.entry_point()  # raises, naming the entry points there are
        return self.records.entry_points[DEFAULT_ENTRY_POINT].signature

    @property
    def program(self) -> LoweredProgram:
        """The default entry point's program and weights (a forward model's)."""
        return self.entry_point()

    @functools.cached_property
    def _weights(self) -> tuple | None:
        """The weight arrays (memory-mapped, after the file matched its sha256), or None for a plan."""
        if self.plan_only:
            return None
        weights = self.records.program
        arrays = map_weights(self.checked_path(weights.path))
        return tuple(arrays[name] for name in weights.names)

    @functools.cached_property
    def generation_program(self):
        """The entry points as the program that drives them (lower.GenerationProgram or Seq2SeqProgram),
        for an artifact whose manifest has a "generation" section.

        Raises:
          TpuExportError: the artifact generates nothing (no "generation" section).
        """
        if "generation" not in self.manifest:
            raise TpuExportError(f"{self.path} has entry points {', '.join(self.records.entry_points)} and does not generate; "
                                 "generation needs a text-generation artifact (convert with --task text-generation)")
        return generation_program(self.manifest["generation"], self.entry_points)

    def stream(self, prompts, max_new_tokens: int, sampling: Sampling = GREEDY, ignore_eos: bool = False) -> Iterator[list[int | None]]:
        """Generation on CPU, step by step (see `generate`): yields each step's new token per prompt
        (None for a row that has finished: it reached max context, or drew an end-of-sequence token,
        which is yielded). An audio encoder-decoder's prompts are its sources' features (a [batch,
        mel bins, frames] array)."""
        if self.plan_only:
            raise TpuExportError("this is a plan without weights: it compiles for TPUs but cannot run; convert the model "
                                 "with its weights to run it")
        with on_host_cpu():
            steps = self.generation_program.stream(source_rows(self.generation_program, prompts), max_new_tokens, sampling=sampling,
                                                   stop_ids=() if ignore_eos else self.eos_token_ids)
        return steps_on_host_cpu(steps)

    @functools.cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids generation stops at, as generate() takes them: a Hugging Face source's
        generation_config.json's eos_token_id (one or several) from hf/, else its config.json's; ()
        for an artifact without them (a model converted from Python: generation runs to the end)."""
        huggingface = self.manifest.get("huggingface") or {}
        if "generation_config.json" in huggingface.get("files", {}):
            value = json.loads(self.read_checked(huggingface["files"]["generation_config.json"])).get("eos_token_id")
        else:
            config = huggingface.get("config") or {}
            value = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
        return () if value is None else (int(value),) if isinstance(value, int) else tuple(int(token) for token in value)

    def tokenizer(self):
        """The Hugging Face tokenizer a text-generation artifact carries (hf/, copied from a Hugging
        Face source directory), loaded from those files alone (no download, no remote code).

        Raises:
          TpuExportError: the artifact has no tokenizer files.
        """
        huggingface = self.manifest.get("huggingface", {})
        files = huggingface.get("files", {})
        if not any(is_tokenizer_file(name) for name in files):
            raise TpuExportError(f"{self.path} carries no tokenizer (its source was not a Hugging Face directory with tokenizer files); "
                                 "pass token ids with --tokens")
        import transformers

        # The class AutoTokenizer picked at conversion, loaded directly: AutoTokenizer itself reads the
        # config through a module that imports torch (about 2 s and 550 MB at a server's start).
        name = huggingface.get("tokenizer_class")
        recorded = getattr(transformers, name, None) if name else None
        tokenizer_class = (recorded if isinstance(recorded, type) and issubclass(recorded, transformers.PreTrainedTokenizerBase)
                           else transformers.AutoTokenizer)
        paths = [self.checked_path(relative) for relative in files.values()]
        return tokenizer_class.from_pretrained(str(paths[0].parent), local_files_only=True, trust_remote_code=False)

    def generate(self, tokens=None, max_new_tokens: int = 32, *, features=None, sampling: Sampling = GREEDY,
                 ignore_eos: bool = False) -> list[list[int]]:
        """Generation by the artifact's prefill, decode and sample entry points on CPU (the lowered
        StableHLO, the KV cache held between steps as on a TPU): greedy by default, as generate()
        with do_sample=False; stops a prompt at an end-of-sequence token (`eos_token_ids`).

        Args:
          tokens: one prompt (a list of token ids) or a list of prompts (at most max batch), or,
            as transformers' generate() takes input_ids, an integer torch tensor or numpy array
            [batch, length] (or [length] for one prompt).
          max_new_tokens: tokens to generate per prompt (fewer where a row reaches max context or
            draws an end-of-sequence token).
          features: instead of tokens, for an audio encoder-decoder (Whisper): its sources' audio
            features, a float array [batch, mel bins, frames] (or [mel bins, frames] for one).
          sampling: temperature, top_p, top_k and seed (tpuexport.Sampling); greedy by default.
          ignore_eos: generate max_new_tokens whatever the end-of-sequence tokens.
        Returns:
          The new tokens per prompt (a list of lists, one per prompt; an end-of-sequence token that
          stopped a prompt is its last).
        Raises:
          TpuExportError: not a text-generation artifact, a plan, or prompts it cannot take (too
            many, too long, empty, a token outside the vocabulary; features of the wrong shape or
            dtype, or given to an artifact that takes tokens).
        """
        if features is not None:
            if tokens is not None:
                raise TpuExportError("give the sources either as tokens or as features, not both")
            prompts = self.feature_sources(features)
        elif tokens is None:
            raise TpuExportError("give the prompts (token ids) or, for an audio encoder-decoder, features=[batch, mel bins, frames]")
        else:
            tokens = _token_lists(tokens)
            prompts = [tokens] if tokens and not isinstance(tokens[0], (list, tuple)) else tokens
        generated: list[list[int]] = [[] for _ in prompts]
        for step in self.stream(prompts, max_new_tokens, sampling, ignore_eos):
            for row, token in enumerate(step):
                if token is not None:
                    generated[row].append(token)
        return generated

    def feature_sources(self, features) -> list:
        """An audio encoder-decoder's sources from its features, [batch, mel bins, frames] (or
        [mel bins, frames] for one): one array per row (checked when generating).

        Raises:
          TpuExportError: an artifact whose sources are token ids.
        """
        if self.generation_program.source_kind != "features":
            raise TpuExportError(f"{self.path} takes token ids, not audio features (its encoder is not an audio model); pass --tokens")
        mel, frames = self.generation_program.spec.features
        try:
            array = np.asarray(features)
        except ValueError:  # rows of different shapes
            raise TpuExportError(f"audio features whose rows differ in shape: {FEATURES_USAGE.format(mel, frames)}") from None
        if array.ndim not in (2, 3):
            raise TpuExportError(f"audio features of shape {list(array.shape)}: {FEATURES_USAGE.format(mel, frames)}")
        return list(array[None] if array.ndim == 2 else array)

    @runs_on_host_cpu
    def run(self, *inputs):
        """Runs the lowered StableHLO on CPU.

        Args:
          *inputs: the model's inputs (torch tensors or numpy arrays, bfloat16 and float16 included), positionally.
        Returns:
          The outputs structured as the model returns them (tensor, tuple, dict), as torch tensors
          in the model's dtypes (a bfloat16 model's logits as torch.bfloat16).
        Raises:
          TpuExportError: a plan (no weights), wrong number of inputs or sizes outside the dims' ranges,
            token rows without the placeholder tokens the signature records (a multimodal model's), or a
            program or weights file that does not match its sha256 in the manifest.
        """
        import torch  # the outputs are torch's; reading and serving an artifact need no torch
        from torch.utils import _pytree as pytree

        from tpuexport.arrays import to_torch

        arrays = [_input_array(value, spec.name) for value, spec in zip(inputs, self.signature.inputs)]
        problem = self.signature.placeholder_error(arrays)
        if problem:
            raise TpuExportError(problem)
        outputs = self.program.run(arrays + list(inputs[len(arrays):]))
        tensors = [to_torch(array).to(getattr(torch, spec.torch_dtype)) for array, spec in zip(outputs, self.signature.outputs)]
        return pytree.tree_unflatten(tensors, pytree.treespec_loads(self.signature.output_tree))

    def read_checked(self, relative: str) -> bytes:
        """A file's bytes, after they matched the file's sha256 in the manifest.

        Raises:
          TpuExportError: the file is missing, unlisted in the manifest or changed.
        """
        path = self._listed_file(relative)
        data = path.read_bytes()
        self._check_digest(relative, hashlib.sha256(data).hexdigest())
        return data

    def checked_path(self, relative: str) -> pathlib.Path:
        """A file's path, after the file (read in blocks, for files larger than memory) matched its
        sha256 in the manifest.

        Raises:
          TpuExportError: the file is missing, unlisted in the manifest or changed.
        """
        path = self._listed_file(relative)
        self._check_digest(relative, sha256_file(path))
        return path

    def _listed_file(self, relative: str) -> pathlib.Path:
        if relative not in self.manifest["files"]:
            raise TpuExportError(f"{self.path / layout.MANIFEST} lists no sha256 for {relative}; the artifact is damaged, convert again")
        path = self.path / relative
        if not path.is_file():
            raise TpuExportError(f"{path} is missing; the artifact is damaged, convert again (`tpuexport verify` lists every damaged file)")
        return path

    def _check_digest(self, relative: str, digest: str) -> None:
        if digest != self.manifest["files"][relative]:
            raise TpuExportError(f"{self.path / relative} does not match its sha256 in the manifest (truncated or modified); "
                                 "the artifact is damaged, convert again (`tpuexport verify` lists every damaged file)")

    def golden_cases(self) -> list[tuple[dict, list[np.ndarray], list[np.ndarray]]]:
        """The default entry point's stored golden cases: (sizes, inputs, eager outputs) each, in
        signature order (none for a plan)."""
        if self.plan_only:
            return []
        from tpuexport.arrays import load_arrays  # torch's safetensors reader: only golden data needs it

        arrays = load_arrays(self.read_checked(self.manifest["verification"]["golden"]))
        cases = []
        for index, case in enumerate(self.manifest["verification"]["cases"]):
            if case["golden"]:
                inputs = [arrays[f"{index}/input/{spec.name}"] for spec in self.signature.inputs]
                outputs = [arrays[f"{index}/output/{spec.name}"] for spec in self.signature.outputs]
                cases.append((case["sizes"], inputs, outputs))
        return cases


def _input_array(value, name: str) -> np.ndarray:
    """A run's input as a numpy array (torch tensors of any dtype and device, bfloat16 included).

    Raises:
      TpuExportError: a value numpy cannot make an array of (ragged nested lists, ...).
    """
    if _is_torch_tensor(value):
        from tpuexport.arrays import to_numpy

        return to_numpy(value.detach().cpu())
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as error:
        raise TpuExportError(f"input {name!r} is not an array ({type(value).__name__}: {error}); pass a tensor or numpy array") from None


def load(path) -> Artifact:
    """Opens an artifact directory.

    Raises:
      TpuExportError: no artifact there, an unreadable manifest, or an unknown format version.
    """
    root = pathlib.Path(path)
    manifest_path = root / layout.MANIFEST
    if not manifest_path.is_file():
        raise TpuExportError(f"{root} is not a tpuexport artifact (no {layout.MANIFEST}); pass the directory convert wrote")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TpuExportError(f"{manifest_path} is not valid JSON ({error}); the artifact is damaged, convert again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != layout.FORMAT:
        raise TpuExportError(f"{manifest_path} is not a tpuexport manifest; the artifact is damaged, convert again")
    try:
        manifest = upgraded(manifest, layout.FORMAT_VERSION)
    except (KeyError, TypeError, AttributeError, ValueError):
        raise TpuExportError(f"{manifest_path} is an incomplete version {manifest.get('format_version')} manifest; the artifact is "
                             "damaged, convert again") from None
    required = {**REQUIRED_MANIFEST_ENTRIES, **({} if manifest.get("plan_only") else VERIFIED_MANIFEST_ENTRIES)}
    entry_points = manifest.get("entry_points")
    for name in (entry_points if isinstance(entry_points, dict) else ()):
        required.update({f"entry_points.{name}.{key}": kind for key, kind in REQUIRED_ENTRY_POINT_ENTRIES.items()})
    for path, kind in required.items():
        if not isinstance(_entry(manifest, path), kind):
            raise TpuExportError(f"{manifest_path} has no valid {path!r}; the artifact is damaged, convert again")
    if not entry_points:
        raise TpuExportError(f"{manifest_path} has no entry points; the artifact is damaged, convert again")
    for named in manifest_paths(manifest):
        if not _stays_inside(root, named):
            raise TpuExportError(f"{manifest_path} names the path {named!r}, which leaves the artifact directory; "
                                 "refusing to read it: the manifest was edited, convert again")
    artifact = Artifact(root, manifest)
    try:
        artifact.records
    except (KeyError, TypeError, AttributeError, ValueError):
        raise TpuExportError(f"{manifest_path} has an entry point, target or bucket record it cannot read; the artifact is damaged, "
                             "convert again") from None
    return artifact


def _entry(manifest: dict, dotted: str):
    value = manifest
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


# Manifest entries that name a path inside the artifact (besides the keys of "files" and the
# executables of every target's buckets, a compile environment's version sets' too).
PATH_ENTRIES = ("program.weights",
                "verification.report", "verification.golden", "tf_serving.saved_model", "tf_serving.warmup_requests",
                "tf_serving.models_config", "tf_serving.batching_parameters", "quantization.report", "quantization.chart")


def manifest_paths(manifest: dict) -> list:
    """Every path inside the artifact the manifest names (values as found: a damaged manifest
    may hold anything there)."""
    named = list(manifest["files"])
    named += [value for value in map(functools.partial(_entry, manifest), PATH_ENTRIES) if value is not None]
    kernel_programs = _entry(manifest, "kernels.programs")
    named += list(kernel_programs.values()) if isinstance(kernel_programs, dict) else []
    entry_points = manifest.get("entry_points")
    for entry in (entry_points.values() if isinstance(entry_points, dict) else ()):
        named += [entry.get(key) for key in ("exported", "mlir_text", "stablehlo_bytecode") if isinstance(entry, dict) and key in entry]
    for entry in manifest["targets"].values():
        sets = entry.get("version_sets") if isinstance(entry, dict) else None
        for holder in [entry, *(sets.values() if isinstance(sets, dict) else ())]:
            buckets = holder.get("buckets", []) if isinstance(holder, dict) else []
            named += [bucket.get("executable") for bucket in buckets if isinstance(bucket, dict) and "executable" in bucket]
    return named


def _stays_inside(root: pathlib.Path, named) -> bool:
    """Whether a manifest path is relative, free of "..", and (following symlinks) inside root."""
    if not isinstance(named, str) or not named or "\\" in named or "\0" in named:
        return False
    if posixpath.isabs(named) or ".." in named.split("/") or pathlib.PureWindowsPath(named).drive:
        return False
    resolved_root = root.resolve()
    return (root / named).resolve().is_relative_to(resolved_root)


def _token_lists(tokens):
    """Token ids given as a torch tensor or numpy array ([batch, length], or [length] for one prompt)
    as lists; lists as they are.

    Raises:
      TpuExportError: an array of floats or of more than 2 dims.
    """
    if not (_is_torch_tensor(tokens) or isinstance(tokens, np.ndarray)):
        return tokens
    array = tokens.detach().cpu().numpy() if _is_torch_tensor(tokens) else tokens
    if array.ndim not in (1, 2) or not np.issubdtype(array.dtype, np.integer):
        raise TpuExportError(f"token ids as an array must be integers of shape [batch, length] or [length]; got {array.dtype} "
                             f"{list(array.shape)}")
    return array.tolist()


def _is_torch_tensor(value) -> bool:
    """Whether `value` is a torch tensor, without importing torch: a process that made one has it."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)
