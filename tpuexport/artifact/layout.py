"""Where each file lives inside an artifact directory (docs/artifact-format.md)."""

from tpuexport.verify.report import GOLDEN_PATH, REPORT_PATH

FORMAT = "tpuexport.artifact"
# 3: every artifact is entry points (a forward model's is "serving_default"); 2: a forward artifact
# held one program. Older versions are read through artifact/upgrade.py.
FORMAT_VERSION = 3

MANIFEST = "manifest.json"
# An entry point's program files, under program/<entry point>/.
EXPORTED = "exported.jaxexport"  # jax.export serialization (flatbuffer), versioned
MLIR_TEXT = "stablehlo.mlir"  # readable MLIR text
STABLEHLO_BYTECODE = "stablehlo.mlirbc"  # portable StableHLO bytecode, versioned
WEIGHTS = "weights/weights.safetensors"
VERIFICATION_REPORT = REPORT_PATH
GOLDEN = GOLDEN_PATH
EXECUTABLES_DIR = "executables"
TF_SERVING_DIR = "tf_serving"  # TF Serving's --model_base_path is tf_serving/<model name>
BATCHING_PARAMETERS = f"{TF_SERVING_DIR}/batching_parameters.txt"  # --batching_parameters_file
MODELS_CONFIG = f"{TF_SERVING_DIR}/models.config"  # --model_config_file
WARMUP_REQUESTS = "assets.extra/tf_serving_warmup_requests"  # inside the SavedModel's version directory


def executable_path(target: str, bucket: str, entry_point: str, version_set: str | None = None) -> str:
    """executables/<target>/<entry point>/<bucket>.pjrt; a compile environment's version set's
    (compile/compile_envs.py, a name of [A-Za-z0-9._-]) under executables/<target>@<version set>/."""
    directory = target if version_set is None else f"{target}@{version_set}"
    return f"{EXECUTABLES_DIR}/{directory}/{entry_point}/{bucket}.pjrt"


def kernel_program_path(entry_point: str, bucket: str) -> str:
    """A bucket's static TPU program with kernels (what its TPU executables were compiled from,
    lower/kernels.py): program/<entry point>/kernels/<bucket>.jaxexport."""
    return f"program/{entry_point}/kernels/{bucket}.jaxexport"


def entry_point_program(entry_point: str, program_file: str) -> str:
    """An entry point's program file: program/<entry point>/<file name> (EXPORTED, MLIR_TEXT or STABLEHLO_BYTECODE)."""
    return f"program/{entry_point}/{program_file}"


def saved_model_path(model_name: str, version: int) -> str:
    """The SavedModel directory, laid out as TF Serving expects: <base path>/<version>."""
    return f"{TF_SERVING_DIR}/{model_name}/{version}"
