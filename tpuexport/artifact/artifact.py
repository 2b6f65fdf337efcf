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

import jax
import numpy as np
import torch
from torch.utils import _pytree as pytree

from tpuexport.arrays import load_arrays, to_numpy
from tpuexport.artifact.weights import map_weights
from tpuexport.artifact import layout
from tpuexport.artifact.manifest import sha256_file
from tpuexport.errors import TpuExportError
from tpuexport.lower import LoweredProgram
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

    @functools.cached_property
    def signature(self) -> ProgramSignature:
        return ProgramSignature.from_json(self.manifest["signature"])

    @functools.cached_property
    def program(self) -> LoweredProgram:
        """The lowered program and weights, read back from the artifact (a plan's has no weights:
        it recompiles but does not run)."""
        program = self.manifest["program"]
        exported = jax.export.deserialize(bytearray(self.read_checked(program["exported"])))
        weights = None
        if not self.plan_only:
            arrays = map_weights(self.checked_path(program["weights"]))
            weights = tuple(arrays[name] for name in program["weight_names"])
        return LoweredProgram(exported, tuple(program["weight_names"]), weights, self.signature, self.manifest["precision"],
                              self.manifest["matmul_precision"], program["matmul_flops"],
                              scanned=tuple(self.manifest.get("scanned", ())), tied=program.get("tied_weights", {}))

    def run(self, *inputs):
        """Runs the lowered StableHLO on CPU.

        Args:
          *inputs: the model's inputs (torch tensors or numpy arrays), positionally.
        Returns:
          The outputs structured as the model returns them (tensor, tuple, dict), as torch tensors
          in the model's dtypes.
        Raises:
          TpuExportError: a plan (no weights), wrong number of inputs or sizes outside the dims' ranges,
            or a program or weights file that does not match its sha256 in the manifest.
        """
        arrays = [_input_array(value, spec.name) for value, spec in zip(inputs, self.signature.inputs)]
        outputs = self.program.run(arrays + list(inputs[len(arrays):]))
        tensors = [
            torch.from_numpy(np.array(array)).to(getattr(torch, spec.torch_dtype))
            for array, spec in zip(outputs, self.signature.outputs)
        ]
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
    required = REQUIRED_MANIFEST_ENTRIES if manifest.get("plan_only") else {**REQUIRED_MANIFEST_ENTRIES, **VERIFIED_MANIFEST_ENTRIES}
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
