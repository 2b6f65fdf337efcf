"""`Artifact`: an artifact directory opened for inspection and CPU runs.

What `load` and `run` read is checked first: every path the manifest names must stay inside the
artifact directory (relative, no "..", no symlink out of it), and each file run reads (program,
weights, golden data) must match its sha256 in the manifest before any of its bytes reach XLA's
parsers or any output is produced. Each file is hashed once per opened Artifact, when it is first
read: the weights (memory-mapped, not read by loading them) cost one sequential read of the file on
the first `run` (300 MiB/s here: benchmarks/load_integrity.py; README, "Integrity on load").
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import posixpath
from typing import Iterator

import jax
import numpy as np
import torch
from torch.utils import _pytree as pytree

from tpuexport.arrays import load_arrays, to_numpy, to_torch
from tpuexport.artifact.weights import map_weights
from tpuexport.artifact import layout
from tpuexport.artifact.manifest import sha256_file
from tpuexport.errors import TpuExportError
from tpuexport.export.huggingface import ARTIFACT_DIRECTORY as HF_DIRECTORY
from tpuexport.lower import GenerationProgram, LoweredProgram, Seq2SeqProgram
from tpuexport.lower.seq2seq import FEATURES_USAGE, source_rows
from tpuexport.signature import ProgramSignature


# What every reader of an artifact (run, inspect, verify) relies on, checked once by `load`.
REQUIRED_MANIFEST_ENTRIES = {
    "versions": dict,
    "precision": str,
    "matmul_precision": str,
    "signature": dict,
    "program": dict,
    "program.exported": str,
    "program.weight_names": list,
    "program.matmul_flops": str,
    "targets": dict,
    "verification": dict,
    "files": dict,
}
# A text-generation artifact has entry points (each with its signature and program files) instead
# of one signature and program; its "program" holds the weights they share.
GENERATION_MANIFEST_ENTRIES = {
    **{name: kind for name, kind in REQUIRED_MANIFEST_ENTRIES.items() if name not in ("signature", "program.exported", "program.matmul_flops")},
    "entry_points": dict,
    "entry_points.prefill": dict,
    "entry_points.decode": dict,
    "generation": dict,
}
# An encoder-decoder's text-generation artifact: encode instead of prefill (export/seq2seq.py).
SEQ2SEQ_MANIFEST_ENTRIES = {**{name: kind for name, kind in GENERATION_MANIFEST_ENTRIES.items() if name != "entry_points.prefill"},
                            "entry_points.encode": dict}
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
        """"forward" (one program) or "text-generation" (entry points prefill and decode)."""
        return self.manifest.get("task", "forward")

    @functools.cached_property
    def signature(self) -> ProgramSignature:
        self._require_task("forward", "signature")
        return ProgramSignature.from_json(self.manifest["signature"])

    @functools.cached_property
    def program(self) -> LoweredProgram:
        """The lowered program and weights, read back from the artifact (a plan's has no weights:
        it recompiles but does not run)."""
        self._require_task("forward", "program")
        program = self.manifest["program"]
        return self._lowered(program["exported"], ProgramSignature.from_json(self.manifest["signature"]), program["matmul_flops"],
                             self._weights, program.get("decision_matmuls", ()))

    @functools.cached_property
    def _weights(self) -> tuple | None:
        """The weight arrays (memory-mapped, after the file matched its sha256), or None for a plan."""
        if self.plan_only:
            return None
        program = self.manifest["program"]
        arrays = map_weights(self.checked_path(program["weights"]))
        return tuple(arrays[name] for name in program["weight_names"])

    def _lowered(self, exported_path: str, signature: ProgramSignature, matmul_flops: str, weights, decisions=()) -> LoweredProgram:
        program = self.manifest["program"]
        exported = jax.export.deserialize(bytearray(self.read_checked(exported_path)))
        return LoweredProgram(exported, tuple(program["weight_names"]), weights, signature, self.manifest["precision"],
                              self.manifest["matmul_precision"], matmul_flops,
                              scanned=tuple(self.manifest.get("scanned", ())), tied=program.get("tied_weights", {}),
                              weight_layouts={name: tuple(layout) for name, layout in program.get("weight_layouts", {}).items()},
                              decision_matmuls=tuple(decisions))

    def _require_task(self, task: str, what: str) -> None:
        if self.task != task:
            if self.task == "text-generation":
                raise TpuExportError(f"{self.path} is a text-generation artifact with entry points prefill and decode and no single "
                                     f"{what}; use Artifact.generate or Artifact.generation_program")
            raise TpuExportError(f"{self.path} is a {self.task} artifact; {what} needs a text-generation artifact "
                                 "(convert with --task text-generation)")

    @functools.cached_property
    def generation_program(self) -> GenerationProgram:
        """A text-generation artifact's entry points over its one set of weights."""
        self._require_task("text-generation", "generation")
        entry_points = {
            name: self._lowered(entry["exported"], ProgramSignature.from_json(entry["signature"]), entry["matmul_flops"], self._weights,
                                entry.get("decision_matmuls", ()))
            for name, entry in self.manifest["entry_points"].items()
        }
        generation = self.manifest["generation"]
        program_type = Seq2SeqProgram if generation.get("kind") == "encoder-decoder" else GenerationProgram
        return program_type.from_manifest(generation, entry_points)

    def stream(self, prompts, max_new_tokens: int) -> Iterator[list[int | None]]:
        """Greedy generation on CPU, step by step (see `generate`): yields each step's new token per
        prompt (None for a row that reached max context). An audio encoder-decoder's prompts are its
        sources' features (a [batch, mel bins, frames] array)."""
        if self.plan_only:
            raise TpuExportError("this is a plan without weights: it compiles for TPUs but cannot run; convert the model "
                                 "with its weights to run it")
        return self.generation_program.stream(source_rows(self.generation_program, prompts), max_new_tokens)

    def tokenizer(self):
        """The Hugging Face tokenizer a text-generation artifact carries (hf/, copied from a Hugging
        Face source directory), loaded from those files alone (no download, no remote code).

        Raises:
          TpuExportError: the artifact has no tokenizer files.
        """
        files = self.manifest.get("huggingface", {}).get("files", [])
        if not any(name.startswith("tokenizer") or name in ("vocab.txt", "vocab.json", "spiece.model") for name in files):
            raise TpuExportError(f"{self.path} carries no tokenizer (its source was not a Hugging Face directory with tokenizer files); "
                                 "pass token ids with --tokens")
        from transformers import AutoTokenizer

        for name in files:
            self.checked_path(f"{HF_DIRECTORY}/{name}")
        return AutoTokenizer.from_pretrained(str(self.path / HF_DIRECTORY), local_files_only=True, trust_remote_code=False)

    def generate(self, tokens=None, max_new_tokens: int = 32, *, features=None) -> list[list[int]]:
        """Greedy generation by the artifact's prefill and decode entry points on CPU (the lowered
        StableHLO, the KV cache held between steps as on a TPU).

        Args:
          tokens: one prompt (a list of token ids) or a list of prompts (at most max batch), or,
            as transformers' generate() takes input_ids, an integer torch tensor or numpy array
            [batch, length] (or [length] for one prompt).
          max_new_tokens: tokens to generate per prompt (fewer where a row reaches max context).
          features: instead of tokens, for an audio encoder-decoder (Whisper): its sources' audio
            features, a float array [batch, mel bins, frames] (or [mel bins, frames] for one).
        Returns:
          The new tokens per prompt (a list of lists, one per prompt).
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
        for step in self.stream(prompts, max_new_tokens):
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
        source = self.generation_program.spec.source if isinstance(self.generation_program, Seq2SeqProgram) else "tokens"
        if source != "features":
            raise TpuExportError(f"{self.path} takes token ids, not audio features (its encoder is not an audio model); pass --tokens")
        mel, frames = self.generation_program.spec.features
        try:
            array = np.asarray(features)
        except ValueError:  # rows of different shapes
            raise TpuExportError(f"audio features whose rows differ in shape: {FEATURES_USAGE.format(mel, frames)}") from None
        if array.ndim not in (2, 3):
            raise TpuExportError(f"audio features of shape {list(array.shape)}: {FEATURES_USAGE.format(mel, frames)}")
        return list(array[None] if array.ndim == 2 else array)

    def run(self, *inputs):
        """Runs the lowered StableHLO on CPU.

        Args:
          *inputs: the model's inputs (torch tensors or numpy arrays, bfloat16 and float16 included), positionally.
        Returns:
          The outputs structured as the model returns them (tensor, tuple, dict), as torch tensors
          in the model's dtypes (a bfloat16 model's logits as torch.bfloat16).
        Raises:
          TpuExportError: a plan (no weights), wrong number of inputs or sizes outside the dims' ranges,
            or a program or weights file that does not match its sha256 in the manifest.
        """
        arrays = [_input_array(value, spec.name) for value, spec in zip(inputs, self.signature.inputs)]
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
        """The stored golden cases: (sizes, inputs, eager outputs) each, in signature order (none for a plan)."""
        self._require_task("forward", "golden cases of one program")
        if self.plan_only:
            return []
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
    if isinstance(value, torch.Tensor):
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
    if manifest.get("format_version") != layout.FORMAT_VERSION:
        raise TpuExportError(
            f"{root} has artifact format version {manifest.get('format_version')!r}; this tpuexport reads version "
            f"{layout.FORMAT_VERSION}, install the tpuexport that wrote it"
        )
    base = REQUIRED_MANIFEST_ENTRIES
    if manifest.get("task") == "text-generation":
        encoder_decoder = isinstance(manifest.get("generation"), dict) and manifest["generation"].get("kind") == "encoder-decoder"
        base = SEQ2SEQ_MANIFEST_ENTRIES if encoder_decoder else GENERATION_MANIFEST_ENTRIES
    required = base if manifest.get("plan_only") else {**base, **VERIFIED_MANIFEST_ENTRIES}
    for path, kind in required.items():
        if not isinstance(_entry(manifest, path), kind):
            raise TpuExportError(f"{manifest_path} has no valid {path!r}; the artifact is damaged, convert again")
    for named in manifest_paths(manifest):
        if not _stays_inside(root, named):
            raise TpuExportError(f"{manifest_path} names the path {named!r}, which leaves the artifact directory; "
                                 "refusing to read it: the manifest was edited, convert again")
    return Artifact(root, manifest)


def _entry(manifest: dict, dotted: str):
    value = manifest
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


# Manifest entries that name a path inside the artifact (besides the keys of "files" and the
# executables of every target's buckets).
PATH_ENTRIES = ("program.exported", "program.mlir_text", "program.stablehlo_bytecode", "program.weights",
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
        buckets = entry.get("buckets", []) if isinstance(entry, dict) else []
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
    if not isinstance(tokens, (torch.Tensor, np.ndarray)):
        return tokens
    array = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else tokens
    if array.ndim not in (1, 2) or not np.issubdtype(array.dtype, np.integer):
        raise TpuExportError(f"token ids as an array must be integers of shape [batch, length] or [length]; got {array.dtype} "
                             f"{list(array.shape)}")
    return array.tolist()
