"""Where each file lives inside an artifact directory (documented in docs/artifact-format.md)."""

FORMAT = "tpuexport.artifact"
FORMAT_VERSION = 2

MANIFEST = "manifest.json"
EXPORTED = "program/exported.jaxexport"  # jax.export serialization (flatbuffer), versioned
MLIR_TEXT = "program/stablehlo.mlir"  # readable MLIR text
STABLEHLO_BYTECODE = "program/stablehlo.mlirbc"  # portable StableHLO bytecode, versioned
WEIGHTS = "weights/weights.safetensors"
VERIFICATION_REPORT = "verification/report.json"
GOLDEN = "verification/golden.safetensors"
EXECUTABLES_DIR = "executables"
TF_SERVING_DIR = "tf_serving"  # TF Serving's --model_base_path is tf_serving/<model name>
BATCHING_PARAMETERS = f"{TF_SERVING_DIR}/batching_parameters.txt"  # --batching_parameters_file
MODELS_CONFIG = f"{TF_SERVING_DIR}/models.config"  # --model_config_file
WARMUP_REQUESTS = "assets.extra/tf_serving_warmup_requests"  # inside the SavedModel's version directory


def executable_path(target: str, bucket: str, entry_point: str | None = None) -> str:
    """executables/<target>/<bucket>.pjrt; a text-generation artifact's under
    executables/<target>/<entry point>/<bucket>.pjrt."""
    return f"{EXECUTABLES_DIR}/{target}/{entry_point + '/' if entry_point else ''}{bucket}.pjrt"


def kernel_program_path(bucket: str) -> str:
    """A bucket's static TPU program with kernels (what its TPU executables were compiled from,
    lower/kernels.py): program/kernels/<bucket>.jaxexport."""
    return f"program/kernels/{bucket}.jaxexport"


def entry_point_program(entry_point: str, program_file: str) -> str:
    """A text-generation entry point's program file: program/<entry point>/<file name> (one of
    EXPORTED, MLIR_TEXT, STABLEHLO_BYTECODE's names)."""
    return f"program/{entry_point}/{program_file.rpartition('/')[2]}"


def saved_model_path(model_name: str, version: int) -> str:
    """The SavedModel directory, laid out as TF Serving expects: <base path>/<version>."""
    return f"{TF_SERVING_DIR}/{model_name}/{version}"
