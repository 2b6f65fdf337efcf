"""The manifest as typed records: what the writer builds and every reader (Artifact, the runtime,
the gate) reads. `Manifest.to_json` is manifest.json; `Manifest.from_json` reads the current format
and upgrades older ones (upgrade.py). The format's history is in docs/artifact-format.md.

Every artifact is named entry points over one set of weights:
  program       the weights every entry point takes first (file, names, ties, layouts)
  entry_points  {name: program files, signature, state, padding}; a forward model's one is
                "serving_default"
  targets       {target: compile key, facts, sharding plan per entry point, buckets}; each bucket
                names its entry point and its executable. With compile environments (--compile-env)
                a target also has "version_sets": {version set: its compile key and buckets}, and
                the manifest's "version_sets" section lists every set's versions (the first is the
                converting interpreter's, whose executables are the target's own buckets)
The other sections (verification, generation, kernels, tf_serving, quantization, huggingface, ...)
are what the task and the conversion's writers put there, kept as JSON.
"""

from __future__ import annotations

import dataclasses

from tpuexport.artifact import layout
from tpuexport.memory import PeakMemory
from tpuexport.signature import ProgramSignature

# How every entry point is called, the same for all of them.
CALL = "exported.call(weights, inputs): two lists, in program.weight_names and this signature's input order"
# The sections between "targets" and "build", in the order they are written.
SECTION_ORDER = ("version_sets", "verification", "scanned", "padding", "kernels", "tf_serving", "quantization", "huggingface")


@dataclasses.dataclass(frozen=True)
class WeightsRecord:
    """The weights every entry point takes (manifest "program").

    Attributes:
      path: the safetensors file inside the artifact, or None for a plan (no weights).
      names: the weights in call order.
      tied: {state_dict name: the weight it is stored and passed as} (an lm_head tied to the embedding).
      layouts: weights stored in another layout than their state_dict tensors: the tensor's axes in stored order.
      weight_bytes: the weights' bytes (of their shapes, also for a plan).
      calling_convention_version: jax.export's calling convention of the entry points' programs.
      platforms: the platforms the programs were exported for.
      serialization: until when newer JAX releases keep loading the programs (compile_key.export_compatibility).
    """

    path: str | None
    names: tuple[str, ...]
    tied: dict[str, str]
    layouts: dict[str, tuple[int, ...]]
    weight_bytes: int
    calling_convention_version: int
    platforms: tuple[str, ...]
    serialization: dict

    def to_json(self) -> dict:
        return {"weights": self.path, "weight_names": list(self.names), "tied_weights": dict(self.tied),
                "weight_layouts": {name: list(axes) for name, axes in self.layouts.items()}, "weight_bytes": self.weight_bytes,
                "calling_convention_version": self.calling_convention_version, "platforms": list(self.platforms),
                "serialization": self.serialization}

    @classmethod
    def from_json(cls, data: dict) -> "WeightsRecord":
        return cls(data.get("weights"), tuple(data["weight_names"]), dict(data.get("tied_weights", {})),
                   {name: tuple(axes) for name, axes in data.get("weight_layouts", {}).items()}, data.get("weight_bytes", 0),
                   data.get("calling_convention_version", 0), tuple(data.get("platforms", ())), data.get("serialization") or {})


@dataclasses.dataclass(frozen=True)
class EntryPointRecord:
    """One entry point (manifest "entry_points"[name]).

    Attributes:
      exported, mlir_text, stablehlo_bytecode: its program files (jax.export serialization,
        readable MLIR, portable StableHLO bytecode).
      signature: its inputs, outputs and dims.
      matmul_flops: FLOPs of its dots and convolutions, an expression over the dim names.
      decision_matmuls: matmuls pinned to "highest" because they feed a top-k, sort or argmax.
      state: inputs it returns as the output of the same name (a KV cache): donated, so XLA updates
        them in place, and kept on the device between calls by a runtime.
      padded_dim: the dim a runtime pads to the next compiled bucket (zero rows, sliced off the
        outputs: only when a padded bucket passed verification), or None for exact sizes only.
      padding_note: why no dim is padded ("" when one is).
    """

    exported: str
    mlir_text: str
    stablehlo_bytecode: str
    signature: ProgramSignature
    matmul_flops: str
    decision_matmuls: tuple[dict, ...] = ()
    state: tuple[str, ...] = ()
    padded_dim: str | None = None
    padding_note: str = ""

    @property
    def files(self) -> tuple[str, ...]:
        return (self.exported, self.mlir_text, self.stablehlo_bytecode)

    def to_json(self) -> dict:
        return {"exported": self.exported, "mlir_text": self.mlir_text, "stablehlo_bytecode": self.stablehlo_bytecode,
                "signature": self.signature.to_json(), "matmul_flops": self.matmul_flops, "decision_matmuls": list(self.decision_matmuls),
                "donated_inputs": list(self.state), "state": {name: name for name in self.state},
                "padding": {"dim": self.padded_dim, "note": self.padding_note}, "call": CALL}

    @classmethod
    def from_json(cls, data: dict) -> "EntryPointRecord":
        padding = data.get("padding") or {}
        return cls(data["exported"], data.get("mlir_text", ""), data.get("stablehlo_bytecode", ""), ProgramSignature.from_json(data["signature"]),
                   data["matmul_flops"], tuple(data.get("decision_matmuls", ())), tuple(data.get("state", {})), padding.get("dim"),
                   padding.get("note", ""))


@dataclasses.dataclass(frozen=True)
class BucketRecord:
    """One compiled executable (an entry in manifest "targets"[target]["buckets"]).

    Attributes:
      entry_point: the entry point it runs.
      name: the bucket's name ("batch8").
      sizes: {dim: size}.
      executable: the serialized executable's path inside the artifact.
      fingerprint: the compiled HLO's fingerprint (compiler drift shows as a different one).
      state_as_bits: the bfloat16 state it takes and returns as uint16 bit patterns (XLA:CPU executables).
      figures: XLA's memory and cost analysis, HBM fit, collectives, kernels, decode-step figures
        (kept as written).
    """

    entry_point: str
    name: str
    sizes: dict[str, int]
    executable: str
    fingerprint: str | None = None
    state_as_bits: tuple[str, ...] = ()
    figures: dict = dataclasses.field(default_factory=dict)

    @property
    def kernels(self) -> dict:
        """Which program it was compiled from (lower/kernels.py): {"program": "static with kernels" | ..., ...}."""
        return self.figures.get("kernels", {})

    def to_json(self) -> dict:
        entry = {"entry_point": self.entry_point, "name": self.name, "sizes": dict(self.sizes), "executable": self.executable,
                 **self.figures, "fingerprint": self.fingerprint}
        if self.state_as_bits:
            entry["state_as_bits"] = list(self.state_as_bits)
        return entry

    @classmethod
    def from_json(cls, data: dict) -> "BucketRecord":
        known = ("entry_point", "name", "sizes", "executable", "fingerprint", "state_as_bits")
        return cls(data["entry_point"], data["name"], dict(data["sizes"]), data["executable"], data.get("fingerprint"),
                   tuple(data.get("state_as_bits", ())), {key: value for key, value in data.items() if key not in known})


@dataclasses.dataclass(frozen=True)
class ExecutableSet:
    """A target's executables compiled by one compile environment (manifest "targets"[name]["version_sets"][set]).

    Attributes:
      compile_key: what they load on: the environment's jax/jaxlib/libtpu versions, the target's facts.
      buckets: its executables, one per bucket of every entry point, as the target's own.
    """

    compile_key: dict
    buckets: tuple[BucketRecord, ...]

    def to_json(self) -> dict:
        return {"compile_key": self.compile_key, "buckets": [bucket.to_json() for bucket in self.buckets]}

    @classmethod
    def from_json(cls, data: dict) -> "ExecutableSet":
        return cls(data.get("compile_key") or {}, tuple(BucketRecord.from_json(bucket) for bucket in data.get("buckets", ())))


@dataclasses.dataclass(frozen=True)
class TargetRecord:
    """One target's executables (manifest "targets"[name]).

    Attributes:
      facts: the target's chip facts (generation, topology, hbm_bytes, platform; a slice's chips,
        devices, hbm_bytes_per_device and device_ids).
      compile_key: what the executables load on (compile/compile_key.py); the runtime compares it with the host.
      sharding: {entry point: its sharding plan (compile.ShardingPlan.to_json)} on a slice, else {}.
      buckets: its executables (the converting interpreter's versions).
      version_sets: {version set name: the executables a compile environment compiled} ({} without --compile-env).
    """

    facts: dict
    compile_key: dict
    sharding: dict[str, dict]
    buckets: tuple[BucketRecord, ...]
    version_sets: dict[str, ExecutableSet] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        entry = {**self.facts, "compile_key": self.compile_key}
        if self.sharding:
            entry["sharding"] = dict(self.sharding)
        entry["buckets"] = [bucket.to_json() for bucket in self.buckets]
        if self.version_sets:
            entry["version_sets"] = {name: executables.to_json() for name, executables in self.version_sets.items()}
        return entry

    @classmethod
    def from_json(cls, data: dict) -> "TargetRecord":
        facts = {key: value for key, value in data.items() if key not in ("compile_key", "sharding", "buckets", "version_sets")}
        return cls(facts, data.get("compile_key") or {}, dict(data.get("sharding", {})),
                   tuple(BucketRecord.from_json(bucket) for bucket in data.get("buckets", ())),
                   {name: ExecutableSet.from_json(executables) for name, executables in (data.get("version_sets") or {}).items()})

    def executable_sets(self) -> dict[str | None, tuple[dict, tuple[BucketRecord, ...]]]:
        """{version set (None: the converting interpreter's): (compile key, buckets)}, the target's own first."""
        return {None: (self.compile_key, self.buckets),
                **{name: (executables.compile_key, executables.buckets) for name, executables in self.version_sets.items()}}


@dataclasses.dataclass(frozen=True)
class Manifest:
    """manifest.json.

    Attributes:
      task: the task that made the entry points ("forward", "text-generation"; tpuexport/tasks).
      plan_only: a plan: compiled from the weights' shapes, no weights, never verified.
      versions: the packages that built it.
      source: where the model came from (export.SourceInfo).
      precision, resolved_precision, matmul_precision: as requested, as resolved, the TPU matmul arithmetic.
      program: the weights every entry point takes.
      entry_points: {name: EntryPointRecord}, in call order.
      targets: {name: TargetRecord}.
      sections: the other sections, by name (verification, generation, kernels, padding, scanned,
        tf_serving, quantization, huggingface, ...), as JSON.
      build: run-dependent figures (creation time, stage and compile seconds, ...).
      files: {relative path: sha256} of every other file.
      stage_memory: {stage: PeakMemory}, the peak resident memory of each stage run (written under
        build "stage_memory", next to "stage_seconds"; empty for an artifact built before it was recorded).
    """

    task: str
    plan_only: bool
    versions: dict
    source: dict
    precision: str
    resolved_precision: str
    matmul_precision: str
    program: WeightsRecord
    entry_points: dict[str, EntryPointRecord]
    targets: dict[str, TargetRecord]
    sections: dict[str, object]
    build: dict = dataclasses.field(default_factory=dict)
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    stage_memory: dict[str, PeakMemory] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        head = {"format": layout.FORMAT, "format_version": layout.FORMAT_VERSION, "task": self.task, "plan_only": self.plan_only,
                "versions": self.versions, "source": self.source, "precision": self.precision,
                "resolved_precision": self.resolved_precision, "matmul_precision": self.matmul_precision,
                "program": self.program.to_json(), "entry_points": {name: entry.to_json() for name, entry in self.entry_points.items()}}
        sections = dict(self.sections)
        generation = {"generation": sections.pop("generation")} if "generation" in sections else {}
        ordered = sorted(sections, key=lambda name: SECTION_ORDER.index(name) if name in SECTION_ORDER else len(SECTION_ORDER))
        return {**head, **generation, "targets": {name: target.to_json() for name, target in self.targets.items()},
                **{name: sections[name] for name in ordered}, "build": self._build_json(), "files": self.files}

    def _build_json(self) -> dict:
        """"build", "stage_memory" right after "stage_seconds" when recorded."""
        if not self.stage_memory:
            return self.build
        memory = {"stage_memory": {name: peak.to_json() for name, peak in self.stage_memory.items()}}
        names = list(self.build)
        at = names.index("stage_seconds") + 1 if "stage_seconds" in names else len(names)
        return {**{name: self.build[name] for name in names[:at]}, **memory, **{name: self.build[name] for name in names[at:]}}

    @classmethod
    def from_json(cls, data: dict) -> "Manifest":
        """Reads a manifest of the current format (older ones are upgraded first: upgrade.upgraded)."""
        named = ("format", "format_version", "task", "plan_only", "versions", "source", "precision", "resolved_precision",
                 "matmul_precision", "program", "entry_points", "targets", "build", "files")
        return cls(data.get("task", "forward"), bool(data.get("plan_only", False)), data.get("versions", {}), data.get("source", {}),
                   data["precision"], data.get("resolved_precision", data["precision"]), data["matmul_precision"],
                   WeightsRecord.from_json(data["program"]),
                   {name: EntryPointRecord.from_json(entry) for name, entry in data["entry_points"].items()},
                   {name: TargetRecord.from_json(target) for name, target in data["targets"].items()},
                   {key: value for key, value in data.items() if key not in named},
                   {key: value for key, value in data.get("build", {}).items() if key != "stage_memory"}, data.get("files", {}),
                   {name: PeakMemory.from_json(peak) for name, peak in data.get("build", {}).get("stage_memory", {}).items()})

    @property
    def verification(self) -> dict:
        return self.sections.get("verification", {})

    def buckets(self, target: str, entry_point: str, version_set: str | None = None) -> tuple[BucketRecord, ...]:
        """A target's executables of one entry point (a compile environment's version set's, when named)."""
        record = self.targets[target]
        buckets = record.buckets if version_set is None else record.version_sets[version_set].buckets
        return tuple(bucket for bucket in buckets if bucket.entry_point == entry_point)
