"""TF Serving export: a SavedModel whose XlaCallModule runs the lowered program, its warmup requests
and server configuration, checked in a TensorFlow-only process."""

from tpuexport.artifact.tf_serving.export import (
    SavedModelMismatch,
    TfServingExport,
    check_model_name,
    check_model_version,
    default_model_name,
)
from tpuexport.artifact.tf_serving.saved_model import tensorflow_module

__all__ = ["SavedModelMismatch", "TfServingExport", "check_model_name", "check_model_version", "default_model_name",
           "tensorflow_module"]
