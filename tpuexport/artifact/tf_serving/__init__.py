"""TF Serving export: a SavedModel whose XlaCallModule runs the lowered program, its warmup requests
and server configuration, all made and checked by a TensorFlow-only process."""

from tpuexport.artifact.tf_serving.check import check_saved_model
from tpuexport.artifact.tf_serving.export import (
    SavedModelBuild,
    SavedModelMismatch,
    TfServingExport,
    check_model_name,
    check_model_version,
    default_model_name,
)
from tpuexport.artifact.tf_serving.tensorflow_process import TensorFlowProcess

__all__ = ["SavedModelBuild", "SavedModelMismatch", "TensorFlowProcess", "TfServingExport", "check_model_name", "check_model_version",
           "check_saved_model",
           "default_model_name"]
