"""The models a server offers: artifacts opened as runners, by TF Serving model name and version."""

from __future__ import annotations

import dataclasses
import pathlib
import threading

from google.protobuf import any_pb2, json_format

from tpuexport.artifact import load
from tpuexport.errors import TpuExportError
from tpuexport.runtime import Runner, open_runner
from tpuexport.serve import protos
from tpuexport.serve.batching import Batcher
from tpuexport.serve.generation import GENERATE_SIGNATURE, GenerationScheduler
from tpuexport.serve.metrics import Metrics

PREDICT_METHOD = "tensorflow/serving/predict"


class ModelNotFound(TpuExportError):
    """No served model (or version) of that name (HTTP 404, gRPC NOT_FOUND)."""


@dataclasses.dataclass
class ServedModel:
    """One model version being served.

    Attributes:
      name: TF Serving's model name (the manifest's tf_serving.model_name, else the artifact's stem).
      version: its version number.
      runner: the runtime holding its executables.
      batcher: where its predict requests queue.
      generation: where its generate requests queue (a text-generation artifact), else None.
      tokenizer: the Hugging Face tokenizer a text-generation artifact carries (hf/), else None.
      tokenizer_lock: held while the tokenizer runs (a fast tokenizer is not safe to call from
        several threads at once: request handlers encode, the scheduler decodes).
    """

    name: str
    version: int
    runner: Runner
    batcher: Batcher
    generation: GenerationScheduler | None = None
    tokenizer: object = None
    tokenizer_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def labels(self) -> dict[str, str]:
        return {"model": self.name, "version": str(self.version)}

    def signature_defs(self) -> dict:
        """{entry point name: SignatureDef} as TF Serving's metadata describes a SavedModel's, and a
        text-generation model's "generate" (what gRPC Predict takes for generation)."""
        signatures = {name: _signature_def(entry.signature.inputs, entry.signature.outputs) for name, entry in self.runner.entry_points.items()}
        if self.generation is not None:
            signatures[GENERATE_SIGNATURE] = _signature_def(*self.generation.signature())
        return signatures

    def metadata_proto(self):
        """The GetModelMetadataResponse of this version."""
        response = protos.get_model_metadata_pb2.GetModelMetadataResponse()
        response.model_spec.name = self.name
        response.model_spec.version.value = self.version
        signatures = protos.get_model_metadata_pb2.SignatureDefMap()
        for name, signature in self.signature_defs().items():
            signatures.signature_def[name].CopyFrom(signature)
        packed = any_pb2.Any()
        packed.Pack(signatures)
        response.metadata["signature_def"].CopyFrom(packed)
        return response

    def metadata_json(self) -> dict:
        """The REST metadata body: {"model_spec", "metadata": {"signature_def": {"signature_def": ...}}}."""
        signatures = {name: json_format.MessageToDict(signature, preserving_proto_field_name=True) for name, signature in self.signature_defs().items()}
        return {
            "model_spec": {"name": self.name, "signature_name": "", "version": str(self.version)},
            "metadata": {"signature_def": {"signature_def": signatures}},
        }


def _signature_def(inputs, outputs):
    """A SignatureDef of TensorSpecs (name, dtype, shape; a symbolic or None size is -1)."""
    signature = protos.meta_graph_pb2.SignatureDef(method_name=PREDICT_METHOD)
    for specs, infos in ((inputs, signature.inputs), (outputs, signature.outputs)):
        for spec in specs:
            info = infos[spec.name]
            info.name = spec.name
            info.dtype = protos.data_type(spec.dtype)
            for size in spec.shape:
                info.tensor_shape.dim.add(size=size if isinstance(size, int) else -1)
    return signature


def _tokenizer(artifact):
    """The artifact's tokenizer (hf/), or None when it carries none."""
    try:
        return artifact.tokenizer()
    except TpuExportError:
        return None


class ModelRepository:
    """Every served model version, with their batchers.

    Args:
      paths: artifact directories; two with the same model name and version are refused.
      batch_timeout: seconds a request waits for others to batch with (0: no batching).
      metrics: the server's metrics.
      allow_recompile: compile the StableHLO where an artifact's compile key differs from the host.
      target: the target to serve from every artifact, None to match the local devices.
      cluster: this process's place in a multi-process run, None for one process.
      prefix_caching: paged artifacts share the pages of identical prompt prefixes (serve/prefix_cache.py).
    Raises:
      TpuExportError: an artifact that cannot be served here (see runtime.open_runner), or a
        model name and version given twice.
    """

    def __init__(self, paths: list[pathlib.Path], batch_timeout: float, metrics: Metrics, allow_recompile: bool = False,
                 target: str | None = None, cluster=None, prefix_caching: bool = True):
        self.models: dict[str, dict[int, ServedModel]] = {}
        for path in paths:
            artifact = load(path)
            serving = artifact.manifest.get("tf_serving") or {}
            name = serving.get("model_name") or pathlib.Path(path).name.split(".")[0]
            version = int(serving.get("model_version", 1))
            if version in self.models.get(name, {}):
                raise TpuExportError(f"{path} is model {name} version {version} again; give each artifact its own --version when "
                                     "converting, or serve one of them")
            runner = open_runner(artifact, target=target, allow_recompile=allow_recompile, cluster=cluster)
            labels = {"model": name, "version": str(version)}
            metrics.compilations_at_start.labels(**labels).set(runner.compilations_at_start)
            generation = (GenerationScheduler(runner, metrics, labels, prefix_caching) if "generation" in runner.artifact.manifest
                          else None)
            self.models.setdefault(name, {})[version] = ServedModel(name, version, runner, Batcher(runner, batch_timeout, metrics, labels),
                                                                    generation, _tokenizer(artifact) if generation is not None else None)

    def __iter__(self):
        return (model for versions in self.models.values() for model in versions.values())

    def resolve(self, name: str, version: int | str | None = None) -> ServedModel:
        """The model version a request names (its latest version when none is given).

        Raises:
          ModelNotFound: no such model or version (the message lists what is served).
        """
        versions = self.models.get(name)
        if not versions:
            raise ModelNotFound(f"Servable not found for request: no model {name!r}; this server has {', '.join(self.models)}")
        if version in (None, "", 0):
            return versions[max(versions)]
        try:
            number = int(version)
        except ValueError:
            raise ModelNotFound(f"version {version!r} of model {name!r} is not a number") from None
        if number not in versions:
            raise ModelNotFound(f"Servable not found for request: model {name!r} has no version {number} "
                                f"(it has {', '.join(map(str, sorted(versions)))})")
        return versions[number]

    def close(self) -> None:
        """Runs the queued requests of every model, then stops their batchers and generation schedulers."""
        for model in self:
            model.batcher.close()
            if model.generation is not None:
                model.generation.close()
            model.runner.close()  # a multi-process run's followers stop
