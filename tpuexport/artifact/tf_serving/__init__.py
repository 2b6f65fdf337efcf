"""TF Serving export: a SavedModel built from the lowered program with jax2tf, its warmup requests
and server configuration, checked in a TensorFlow-only process."""

from tpuexport.artifact.tf_serving.export import (
    SavedModelMismatch,
    TfServingExport,
    check_model_name,
    check_model_version,
    default_model_name,
)

__all__ = ["SavedModelMismatch", "TfServingExport", "check_model_name", "check_model_version", "default_model_name"]
