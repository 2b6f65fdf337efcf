"""TF Serving's configuration files (text protos) and the server command line that uses them.

Server-side batching concatenates requests along dim 0 of every input and splits the outputs
along dim 0, so it is configured only when one symbolic dim (the batch) leads every input and
every output. Its allowed batch sizes are the compiled bucket sizes of that dim: the server pads
each batch up to one of them, so every batch runs at a shape a TPU executable exists for.
"""

from __future__ import annotations

from typing import Sequence

from tpuexport.compile import Bucket
from tpuexport.signature import ProgramSignature

# A batch waits at most 1 ms for more requests: small next to a TPU step's dispatch overhead.
BATCH_TIMEOUT_MICROS = 1000
NUM_BATCH_THREADS = 4
MAX_ENQUEUED_BATCHES = 100


def batch_dim(signature: ProgramSignature) -> str | None:
    """The dim server-side batching can batch along, or None (ProgramSignature.batch_dim)."""
    return signature.batch_dim()


def allowed_batch_sizes(batch: str, buckets: Sequence[Bucket]) -> list[int]:
    """The compiled sizes of the batch dim, ascending."""
    return sorted({bucket.as_dict()[batch] for bucket in buckets})


def batching_parameters_text(batch: str, sizes: Sequence[int], varying_dims: Sequence[str]) -> str:
    """The --batching_parameters_file contents (a BatchingParameters text proto).

    Args:
      batch: the batch dim's name (for the comment).
      sizes: allowed batch sizes, ascending; the largest is max_batch_size, as TF Serving requires.
      varying_dims: the other symbolic dims; requests that differ in them cannot share a batch.
    Returns:
      The file's text.
    """
    lines = [
        f"# Server-side batching along dim 0 ({batch}); allowed sizes are the compiled TPU buckets.",
        f"max_batch_size {{ value: {max(sizes)} }}",
        f"batch_timeout_micros {{ value: {BATCH_TIMEOUT_MICROS} }}",
        f"num_batch_threads {{ value: {NUM_BATCH_THREADS} }}",
        f"max_enqueued_batches {{ value: {MAX_ENQUEUED_BATCHES} }}",
        *(f"allowed_batch_sizes: {size}" for size in sizes),
    ]
    if varying_dims:
        # Zero padding changes results unless the model masks it out, so it stays opt-in.
        lines.insert(1, f"# Requests with different {', '.join(varying_dims)} only batch together with "
                        "pad_variable_length_inputs: true, which pads with zeros.")
    return "\n".join(lines) + "\n"


def models_config_text(model_name: str, base_path: str, version: int) -> str:
    """The --model_config_file contents (a ModelServerConfig text proto) serving one version."""
    return (
        "model_config_list {\n"
        "  config {\n"
        f'    name: "{model_name}"\n'
        f'    base_path: "{base_path}"\n'
        '    model_platform: "tensorflow"\n'
        f"    model_version_policy {{ specific {{ versions: {version} }} }}\n"
        "  }\n"
        "}\n"
    )


def server_command(model_name: str, base_path: str, batching_parameters: str | None) -> str:
    """The tensorflow_model_server command line serving the model (gRPC 8500, REST 8501)."""
    parts = [
        "tensorflow_model_server", "--port=8500", "--rest_api_port=8501",
        f"--model_name={model_name}", f"--model_base_path={base_path}",
    ]
    if batching_parameters:
        parts += ["--enable_batching", f"--batching_parameters_file={batching_parameters}"]
    parts.append("--enable_model_warmup")
    return " ".join(parts)
