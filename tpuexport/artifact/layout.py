"""Where each file lives inside an artifact directory (documented in the README)."""

FORMAT = "tpuexport.artifact"
FORMAT_VERSION = 1

MANIFEST = "manifest.json"
EXPORTED = "program/exported.jaxexport"  # jax.export serialization (flatbuffer), versioned
MLIR_TEXT = "program/stablehlo.mlir"  # readable MLIR text
STABLEHLO_BYTECODE = "program/stablehlo.mlirbc"  # portable StableHLO bytecode, versioned
WEIGHTS = "weights/weights.safetensors"
VERIFICATION_REPORT = "verification/report.json"
GOLDEN = "verification/golden.safetensors"
EXECUTABLES_DIR = "executables"
TF_SERVING_DIR = "tf_serving"


def executable_path(target: str, bucket: str) -> str:
    return f"{EXECUTABLES_DIR}/{target}/{bucket}.pjrt"
