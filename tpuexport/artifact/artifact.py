"""`Artifact`: an artifact directory opened for inspection and CPU runs."""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Iterator

import jax
import numpy as np
import torch
from torch.utils import _pytree as pytree

from tpuexport.arrays import load_arrays
from tpuexport.artifact.weights import map_weights
from tpuexport.artifact import layout
from tpuexport.errors import TpuExportError
from tpuexport.export import GenerationSpec
from tpuexport.lower import GenerationProgram, GenerationSession, LoweredProgram, stream_greedy
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
                             self._weights)

    @functools.cached_property
    def _weights(self) -> tuple | None:
        """The weight arrays (memory-mapped), or None for a plan."""
        if self.plan_only:
            return None
        program = self.manifest["program"]
        arrays = map_weights(self.path / program["weights"])
        return tuple(arrays[name] for name in program["weight_names"])

    def _lowered(self, exported_path: str, signature: ProgramSignature, matmul_flops: str, weights) -> LoweredProgram:
        program = self.manifest["program"]
        exported = jax.export.deserialize(bytearray((self.path / exported_path).read_bytes()))
        return LoweredProgram(exported, tuple(program["weight_names"]), weights, signature, self.manifest["precision"],
                              self.manifest["matmul_precision"], matmul_flops,
                              scanned=tuple(self.manifest.get("scanned", ())), tied=program.get("tied_weights", {}))

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
            name: self._lowered(entry["exported"], ProgramSignature.from_json(entry["signature"]), entry["matmul_flops"], self._weights)
            for name, entry in self.manifest["entry_points"].items()
        }
        generation = self.manifest["generation"]
        return GenerationProgram(GenerationSpec.from_json(generation), entry_points, tuple(generation["prefill_batches"]))

    def stream(self, prompts, max_new_tokens: int) -> Iterator[list[int | None]]:
        """Greedy generation on CPU, step by step (see `generate`): yields each step's new token per
        prompt (None for a row that reached max context)."""
        if self.plan_only:
            raise TpuExportError("this is a plan without weights: it compiles for TPUs but cannot run; convert the model "
                                 "with its weights to run it")
        program = self.generation_program
        return stream_greedy(GenerationSession(program), [list(map(int, prompt)) for prompt in prompts], max_new_tokens)

    def generate(self, tokens, max_new_tokens: int = 32) -> list[list[int]]:
        """Greedy generation by the artifact's prefill and decode entry points on CPU (the lowered
        StableHLO, the KV cache held between steps as on a TPU).

        Args:
          tokens: one prompt (a list of token ids) or a list of prompts (at most max batch).
          max_new_tokens: tokens to generate per prompt (fewer where a row reaches max context).
        Returns:
          The new tokens per prompt (a list of lists, one per prompt).
        Raises:
          TpuExportError: not a text-generation artifact, a plan, or prompts it cannot take (too
            many, too long, empty, a token outside the vocabulary).
        """
        prompts = [tokens] if tokens and not isinstance(tokens[0], (list, tuple)) else tokens
        generated: list[list[int]] = [[] for _ in prompts]
        for step in self.stream(prompts, max_new_tokens):
            for row, token in enumerate(step):
                if token is not None:
                    generated[row].append(token)
        return generated

    def run(self, *inputs):
        """Runs the lowered StableHLO on CPU.

        Args:
          *inputs: the model's inputs (torch tensors or numpy arrays), positionally.
        Returns:
          The outputs structured as the model returns them (tensor, tuple, dict), as torch tensors
          in the model's dtypes.
        Raises:
          TpuExportError: a plan (no weights), wrong number of inputs or sizes outside the dims' ranges.
        """
        arrays = [value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value) for value in inputs]
        outputs = self.program.run(arrays)
        tensors = [
            torch.from_numpy(np.array(array)).to(getattr(torch, spec.torch_dtype))
            for array, spec in zip(outputs, self.signature.outputs)
        ]
        return pytree.tree_unflatten(tensors, pytree.treespec_loads(self.signature.output_tree))

    def golden_cases(self) -> list[tuple[dict, list[np.ndarray], list[np.ndarray]]]:
        """The stored golden cases: (sizes, inputs, eager outputs) each, in signature order (none for a plan)."""
        self._require_task("forward", "golden cases of one program")
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
    base = GENERATION_MANIFEST_ENTRIES if manifest.get("task") == "text-generation" else REQUIRED_MANIFEST_ENTRIES
    required = base if manifest.get("plan_only") else {**base, **VERIFIED_MANIFEST_ENTRIES}
    for path, kind in required.items():
        value = manifest
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if not isinstance(value, kind):
            raise TpuExportError(f"{manifest_path} has no valid {path!r}; the artifact is damaged, convert again")
    return Artifact(root, manifest)
