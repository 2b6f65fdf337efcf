"""TF Serving's gRPC API over the runtime: PredictionService (Predict, GetModelMetadata) and
ModelService (GetModelStatus), from the tensorflow-serving-api protos, so that existing clients
(`prediction_service_pb2_grpc.PredictionServiceStub`) work unchanged.

A text-generation model also answers Predict with `signature_name` "generate": its input "prompts"
(int [batch, length], token ids) or, for an audio encoder-decoder, "features" (float32 [batch,
mel bins, frames]; the efficient way to send real features, 80 x 3000 floats per source, as raw
bytes), optionally "max_new_tokens" (an int scalar, default 32); it runs through the model's
continuous batching scheduler (serve/generation.py) and answers "tokens" (int64 [batch, steps], -1
for the steps after a row reached max context).

A bad request answers INVALID_ARGUMENT naming the problem, an unknown model NOT_FOUND, a request
during shutdown UNAVAILABLE; the server serves on.
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import numpy as np

from tpuexport.errors import TpuExportError
from tpuexport.serve import protos
from tpuexport.runtime.processes import ProcessLost
from tpuexport.serve.batching import ShuttingDown
from tpuexport.serve.generation import DEFAULT_NEW_TOKENS, FEATURES, GENERATE_SIGNATURE, PROMPTS
from tpuexport.serve.metrics import UNKNOWN_MODEL, Metrics
from tpuexport.serve.models import ModelNotFound, ModelRepository

# gRPC's default message limit is 4 MB; a batch of inputs may be larger.
MAX_MESSAGE_BYTES = 64 << 20


class PredictionService(protos.prediction_service_pb2_grpc.PredictionServiceServicer):
    """Predict and GetModelMetadata (Classify, Regress and MultiInference answer UNIMPLEMENTED)."""

    def __init__(self, repository: ModelRepository, metrics: Metrics):
        self.repository = repository
        self.metrics = metrics

    def Predict(self, request, context):
        start = time.perf_counter()
        labels = {"model": UNKNOWN_MODEL, "version": ""}  # until the model resolves
        outcome = "ok"
        try:
            version = request.model_spec.version.value if request.model_spec.HasField("version") else None
            model = self.repository.resolve(request.model_spec.name, version)
            labels = model.labels
            inputs = {name: protos.to_array(tensor, name) for name, tensor in request.inputs.items()}
            if request.model_spec.signature_name == GENERATE_SIGNATURE and model.generation is not None:
                return self._generate(model, inputs, context)
            prepared = model.runner.prepare(inputs, request.model_spec.signature_name or None)
            outputs = model.batcher.submit(prepared).result()
            wanted = list(request.output_filter) or list(outputs)
            unknown = [name for name in wanted if name not in outputs]
            if unknown:
                raise TpuExportError(f"output_filter names unknown output(s) {', '.join(unknown)}; the outputs are: {', '.join(outputs)}")
            response = protos.predict_pb2.PredictResponse()
            response.model_spec.name = model.name
            response.model_spec.version.value = model.version
            response.model_spec.signature_name = prepared.entry.name
            for name in wanted:
                response.outputs[name].CopyFrom(protos.to_proto(outputs[name]))
            return response
        except ModelNotFound as error:
            outcome = "not_found"
            context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        except (ShuttingDown, ProcessLost) as error:
            outcome = "unavailable"
            context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except TpuExportError as error:
            outcome = "bad_request"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except Exception as error:  # a failure inside a run: this request fails, the server serves on
            outcome = "error"
            context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {' '.join(str(error).split())[:300]}")
        finally:
            self.metrics.requests.labels(**labels, api="grpc", outcome=outcome).inc()
            self.metrics.latency.labels(**labels, api="grpc").observe(time.perf_counter() - start)

    def _generate(self, model, inputs: dict[str, np.ndarray], context):
        """A generate request's answer: every step's tokens, once the request is done.

        Raises:
          TpuExportError: inputs that are not one of "prompts"/"features" (and "max_new_tokens"),
            or rows the model cannot take.
        """
        rows, kind, max_new_tokens = _generate_inputs(inputs)
        steps = model.generation.submit(rows, max_new_tokens, kind)
        context.add_callback(steps.cancel)  # a client gone frees the request's slots (a no-op once it is done)
        tokens = np.array([[-1 if token is None else token for token in step.tokens] for step in steps], np.int64).T
        response = protos.predict_pb2.PredictResponse()
        response.model_spec.name = model.name
        response.model_spec.version.value = model.version
        response.model_spec.signature_name = GENERATE_SIGNATURE
        response.outputs["tokens"].CopyFrom(protos.to_proto(tokens))
        return response

    def GetModelMetadata(self, request, context):
        try:
            version = request.model_spec.version.value if request.model_spec.HasField("version") else None
            model = self.repository.resolve(request.model_spec.name, version)
        except ModelNotFound as error:
            context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        if list(request.metadata_field) not in ([], ["signature_def"]):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"metadata_field {list(request.metadata_field)}: only signature_def is served")
        return model.metadata_proto()


def _generate_inputs(inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, str, int]:
    """(rows, their kind, max new tokens) of a gRPC generate request.

    Raises:
      TpuExportError: other inputs, token ids that are not integers [batch, length], or a
        max_new_tokens that is not one whole number of at least 1.
    """
    unknown = sorted(set(inputs) - {PROMPTS, FEATURES, "max_new_tokens"})
    if unknown or (PROMPTS in inputs) == (FEATURES in inputs):
        raise TpuExportError(f'generate takes the input "prompts" (int [batch, length] token ids) or "features" (float32 [batch, mel bins, '
                             f'frames]) and optionally "max_new_tokens"; got {", ".join(map(repr, sorted(inputs))) or "no inputs"}')
    max_new_tokens = inputs.get("max_new_tokens", np.array(DEFAULT_NEW_TOKENS))
    if max_new_tokens.size != 1 or max_new_tokens.dtype.kind not in "iu" or int(max_new_tokens.reshape(())) < 1:
        raise TpuExportError('"max_new_tokens" must be one whole number (an int tensor of one value) of at least 1')
    if PROMPTS in inputs:
        prompts = inputs[PROMPTS]
        if prompts.dtype.kind not in "iu" or prompts.ndim != 2:
            raise TpuExportError(f'"prompts" must be token ids, an int tensor [batch, length]; got {prompts.dtype.name} of shape {list(prompts.shape)}')
        return prompts, PROMPTS, int(max_new_tokens.reshape(()))
    return inputs[FEATURES], FEATURES, int(max_new_tokens.reshape(()))


class ModelService(protos.model_service_pb2_grpc.ModelServiceServicer):
    """GetModelStatus (HandleReloadConfigRequest answers UNIMPLEMENTED: models are fixed at start)."""

    def __init__(self, repository: ModelRepository):
        self.repository = repository

    def GetModelStatus(self, request, context):
        try:
            version = request.model_spec.version.value if request.model_spec.HasField("version") else None
            model = self.repository.resolve(request.model_spec.name, version)
        except ModelNotFound as error:
            context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        served = [model] if version else list(self.repository.models[model.name].values())
        response = protos.get_model_status_pb2.GetModelStatusResponse()
        for entry in served:
            status = response.model_version_status.add()
            status.version = entry.version
            status.state = protos.get_model_status_pb2.ModelVersionStatus.AVAILABLE
        return response


def start_grpc_server(repository: ModelRepository, metrics: Metrics, host: str, port: int, workers: int = 16) -> tuple[grpc.Server, int]:
    """Starts the gRPC server (in its own threads).

    Args:
      repository: the served models.
      metrics: the server's metrics.
      host: the address to listen on.
      port: the port (0 picks a free one).
      workers: threads answering requests (each waits for its batch).
    Returns:
      (the started server, the port it listens on).
    Raises:
      TpuExportError: the port cannot be bound.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
                         options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    protos.prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(PredictionService(repository, metrics), server)
    protos.model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(repository), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as error:
        raise TpuExportError(f"cannot listen for gRPC on {host}:{port} ({error}); choose another --grpc-port") from None
    if not bound:
        raise TpuExportError(f"cannot listen for gRPC on {host}:{port}; choose another --grpc-port")
    server.start()
    return server, bound
