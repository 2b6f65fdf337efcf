"""TF Serving's protos (tensorflow-serving-api), and numpy arrays to and from TensorProtos.

The generated modules import TensorFlow's own protos (`tensorflow.core.framework.*_pb2`), and
importing those runs `tensorflow/__init__.py`: all of TensorFlow, about 5 s and hundreds of MB, of
which the server needs nothing but the message classes. So `tensorflow` is stood in for by an
empty package over the same directory while the protos import (the generated files load as they
are, nothing else of TensorFlow runs) and removed again at once, unless TensorFlow was already
imported; a later `import tensorflow` then imports the real package and finds these modules loaded.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import ml_dtypes
import numpy as np

from tpuexport.errors import TpuExportError


def _import_protos():
    stood_in = "tensorflow" not in sys.modules
    if stood_in:
        spec = importlib.util.find_spec("tensorflow")
        package = types.ModuleType("tensorflow")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["tensorflow"] = package
    try:
        from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorflow.core.protobuf import meta_graph_pb2
        from tensorflow_serving.apis import (
            get_model_metadata_pb2, get_model_status_pb2, model_service_pb2_grpc, predict_pb2, prediction_service_pb2_grpc,
        )
    finally:
        if stood_in:
            del sys.modules["tensorflow"]
    return (tensor_pb2, tensor_shape_pb2, types_pb2, meta_graph_pb2, get_model_metadata_pb2, get_model_status_pb2,
            model_service_pb2_grpc, predict_pb2, prediction_service_pb2_grpc)


(tensor_pb2, tensor_shape_pb2, types_pb2, meta_graph_pb2, get_model_metadata_pb2, get_model_status_pb2,
 model_service_pb2_grpc, predict_pb2, prediction_service_pb2_grpc) = _import_protos()

# numpy dtype name <-> TensorFlow DataType, and the TensorProto field holding values of each.
_DATA_TYPES = {
    "float32": (types_pb2.DT_FLOAT, "float_val"),
    "float64": (types_pb2.DT_DOUBLE, "double_val"),
    "float16": (types_pb2.DT_HALF, "half_val"),
    "bfloat16": (types_pb2.DT_BFLOAT16, "half_val"),
    "int8": (types_pb2.DT_INT8, "int_val"),
    "int16": (types_pb2.DT_INT16, "int_val"),
    "int32": (types_pb2.DT_INT32, "int_val"),
    "int64": (types_pb2.DT_INT64, "int64_val"),
    "uint8": (types_pb2.DT_UINT8, "int_val"),
    "uint16": (types_pb2.DT_UINT16, "int_val"),
    "uint32": (types_pb2.DT_UINT32, "uint32_val"),
    "uint64": (types_pb2.DT_UINT64, "uint64_val"),
    "bool": (types_pb2.DT_BOOL, "bool_val"),
}
_BY_ENUM = {enum: (name, field) for name, (enum, field) in _DATA_TYPES.items()}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of an artifact dtype name (bfloat16 through ml_dtypes)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def data_type(name: str) -> int:
    """TensorFlow's DataType enum of an artifact dtype name."""
    return _DATA_TYPES[name][0]


def to_array(proto, name: str) -> np.ndarray:
    """A TensorProto as a numpy array.

    Args:
      proto: the TensorProto.
      name: the input's name, for messages.
    Returns:
      The array, in the proto's dtype.
    Raises:
      TpuExportError: a dtype the server does not take (strings, complex, ...), or values that do
        not fill the shape.
    """
    if proto.dtype not in _BY_ENUM:
        raise TpuExportError(f"input {name!r} has dtype {types_pb2.DataType.Name(proto.dtype) if proto.dtype in types_pb2.DataType.values() else proto.dtype}, "
                             "which this model does not take; send the dtype its metadata lists")
    dtype_name, field = _BY_ENUM[proto.dtype]
    dtype = numpy_dtype(dtype_name)
    shape = tuple(dim.size for dim in proto.tensor_shape.dim)
    if any(size < 0 for size in shape):
        raise TpuExportError(f"input {name!r} has an unknown dim size in its shape {list(shape)}; send concrete sizes")
    count = int(np.prod(shape, dtype=np.int64))
    if proto.tensor_content:
        if len(proto.tensor_content) != count * dtype.itemsize:
            raise TpuExportError(f"input {name!r} has {len(proto.tensor_content)} bytes of content, its shape {list(shape)} "
                                 f"of {dtype_name} needs {count * dtype.itemsize}")
        return np.frombuffer(proto.tensor_content, dtype=dtype).reshape(shape)
    values = getattr(proto, field)
    if field == "half_val":  # the 16 bits of each value, in an int32 each
        array = np.asarray(values, dtype=np.uint16).view(dtype)
    else:
        array = np.asarray(values, dtype=dtype)
    if array.size == count:
        return array.reshape(shape)
    if array.size == 1:  # TensorFlow fills a shape from one value
        return np.full(shape, array[0], dtype=dtype)
    raise TpuExportError(f"input {name!r} has {array.size} values, its shape {list(shape)} needs {count}")


def to_proto(array: np.ndarray):
    """A numpy array as a TensorProto (shape and tensor_content, as tf.make_tensor_proto writes;
    the host's byte order, little-endian on the x86 and Arm hosts TPUs and this server run on)."""
    dtype_name = "bfloat16" if array.dtype == ml_dtypes.bfloat16 else array.dtype.name
    shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=size) for size in array.shape])
    return tensor_pb2.TensorProto(dtype=data_type(dtype_name), tensor_shape=shape,
                                  tensor_content=np.ascontiguousarray(array).tobytes())
