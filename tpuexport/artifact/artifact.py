"""`Artifact`: an artifact directory opened for inspection and CPU runs."""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import numpy as np
import torch
from torch.utils import _pytree as pytree

from tpuexport.arrays import load_arrays, to_numpy, to_torch
from tpuexport.artifact.weights import map_weights
from tpuexport.artifact import layout
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
        exported = jax.export.deserialize(bytearray((self.path / program["exported"]).read_bytes()))
        weights = None
        if not self.plan_only:
            arrays = map_weights(self.path / program["weights"])
            weights = tuple(arrays[name] for name in program["weight_names"])
        return LoweredProgram(exported, tuple(program["weight_names"]), weights, self.signature, self.manifest["precision"],
                              self.manifest["matmul_precision"], program["matmul_flops"],
                              scanned=tuple(self.manifest.get("scanned", ())), tied=program.get("tied_weights", {}),
                              decision_matmuls=tuple(program.get("decision_matmuls", ())))

    def run(self, *inputs):
        """Runs the lowered StableHLO on CPU.

        Args:
          *inputs: the model's inputs (torch tensors or numpy arrays, bfloat16 and float16 included), positionally.
        Returns:
          The outputs structured as the model returns them (tensor, tuple, dict), as torch tensors
          in the model's dtypes (a bfloat16 model's logits as torch.bfloat16).
        Raises:
          TpuExportError: a plan (no weights), wrong number of inputs or sizes outside the dims' ranges.
        """
        arrays = [to_numpy(value.detach().cpu()) if isinstance(value, torch.Tensor) else np.asarray(value) for value in inputs]
        outputs = self.program.run(arrays)
        tensors = [to_torch(array).to(getattr(torch, spec.torch_dtype)) for array, spec in zip(outputs, self.signature.outputs)]
        return pytree.tree_unflatten(tensors, pytree.treespec_loads(self.signature.output_tree))

    def golden_cases(self) -> list[tuple[dict, list[np.ndarray], list[np.ndarray]]]:
        """The stored golden cases: (sizes, inputs, eager outputs) each, in signature order (none for a plan)."""
        if self.plan_only:
            return []
        arrays = load_arrays((self.path / self.manifest["verification"]["golden"]).read_bytes())
        cases = []
        for index, case in enumerate(self.manifest["verification"]["cases"]):
            if case["golden"]:
                inputs = [arrays[f"{index}/input/{spec.name}"] for spec in self.signature.inputs]
                outputs = [arrays[f"{index}/output/{spec.name}"] for spec in self.signature.outputs]
                cases.append((case["sizes"], inputs, outputs))
        return cases


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
        value = manifest
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if not isinstance(value, kind):
            raise TpuExportError(f"{manifest_path} has no valid {path!r}; the artifact is damaged, convert again")
    return Artifact(root, manifest)
