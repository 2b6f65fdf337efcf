"""The TensorFlow side of an artifact, in a process with TensorFlow and nothing of tpuexport, torch
or jax, as a TF Serving host has; run by tensorflow_process.py, not imported.

    python -I tensorflow_child.py        (JSON lines: requests on stdin, one reply per request on stdout)

It imports TensorFlow first and announces itself with one line ({"ready": ..., TensorFlow's and its
StableHLO's versions}), so that a conversion can start it before anything else and TensorFlow's
import overlaps the conversion's other stages. Then, per request line:

  {"op": "load_module", "module": path}   TensorFlow's StableHLO reader loads the program's module
  {"op": "build", ...}                    saves the SavedModel: the module's XlaCallModule fed by the
                                          weights (read from the artifact's safetensors) as variables
  {"op": "warmup", ...}                   writes TF Serving's warmup file (PredictionLog TFRecord)
  {"op": "check", ...}                    runs serving_default on the golden cases and compares each
                                          output with the eager one, with the verify stage's compare.py
                                          (loaded by path), and once at out-of-range sizes

Every reply has "ok" (and "error" when not ok). The process ends when its stdin closes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import re
import struct
import sys
import tempfile
import time

# tensorflow.lite imports jax when it can; blocking it (and torch) proves the SavedModel needs neither.
for _blocked in ("jax", "torch"):
    sys.modules[_blocked] = None

SHAPE_ASSERTION = re.compile(r"Input shapes do not match the symbolic shape constraint [^.]*")
SIGNATURE_NAME = "serving_default"


@contextlib.contextmanager
def native_stderr_lines():
    """Collects what native code writes to fd 2 (TensorFlow's StableHLO reader says there why it refuses)."""
    captured: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.extend(sink.read().decode(errors="replace").splitlines())


def numpy_dtype(name: str):
    import numpy as np
    import tensorflow as tf

    return tf.bfloat16.as_numpy_dtype if name == "bfloat16" else np.dtype(name)


SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64", "I32": "int32",
                      "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def read_safetensors(path: str) -> dict:
    """{name: array} from a safetensors file, bfloat16 included (safetensors' numpy reader has no
    bfloat16), as views of a memory map: the weights are not read into this process's memory
    before TensorFlow copies them into its variables."""
    import numpy as np

    with open(path, "rb") as file:
        (header_size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_size))
    body = np.memmap(path, dtype=np.uint8, mode="r")[8 + header_size:]
    arrays = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        arrays[name] = body[start:end].view(numpy_dtype(SAFETENSORS_DTYPES[entry["dtype"]])).reshape(entry["shape"])
    return arrays


def load_module(request: dict) -> dict:
    from tensorflow.compiler.mlir.stablehlo import stablehlo as tf_stablehlo

    with open(request["module"], "rb") as file:
        module = file.read()
    with native_stderr_lines() as diagnostics:
        try:
            tf_stablehlo.deserialize_portable_artifact_str(module)
            failure = None
        except Exception as error:  # MLIR raises ValueError or RuntimeError with few details
            failure = error
    if failure is None:
        return {"ok": True}
    reasons = [line for line in diagnostics if "error:" in line] or [str(failure)]
    return {"ok": False, "error": " ".join(reasons[0].split("error:", 1)[-1].split())[:200]}


def variable_name(weight_name: str) -> str:
    """State-dict names ("layers.0.weight") are valid variable names, except for a leading underscore
    ("_offset", PT2E's "_frozen_param0"), which TensorFlow refuses at the start of a scope name; the
    variables are found by position anyway."""
    return weight_name.lstrip("_") or "weight"


def build(request: dict) -> dict:
    """Saves the SavedModel: one XlaCallModule of the program, fed by the weights as non-trainable variables."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.python import xla as tfxla

    started = time.perf_counter()
    with open(request["module"], "rb") as file:
        module_bytes = file.read()
    weights = read_safetensors(request["weights"])
    call = request["call"]
    model = tf.Module()
    model.weights = [tf.Variable(weights[name], trainable=False, name=variable_name(name)) for name in request["weight_names"]]
    specs = [tf.TensorSpec(spec["shape"], tf.as_dtype(spec["dtype"]), name=spec["name"]) for spec in request["inputs"]]
    outputs = request["outputs"]

    @tf.function(input_signature=specs, autograph=False)
    def serve(*inputs):
        # The program's flat arguments are the weights, then the inputs; it keeps those it reads.
        arguments = [*model.weights, *inputs]
        results = tfxla.call_module(
            [arguments[index] for index in call["kept_arguments"]],
            version=call["version"],
            module=module_bytes,
            Tout=[tf.as_dtype(dtype) for dtype in call["output_dtypes"]],
            Sout=call["output_shapes"],
            platforms=call["platforms"],
            function_list=[],
            has_token_input_output=False,
            disabled_checks=call["disabled_checks"],
            use_shardy_partitioner=call["use_shardy_partitioner"],
        )
        return {name: result for name, result in zip(outputs, results)}

    model.serve = serve
    tf.saved_model.save(model, request["directory"], signatures={SIGNATURE_NAME: serve})
    # The variables hold the whole model; the check loads it again from the SavedModel. The
    # function and the module refer to each other, so only the collector frees them.
    del model, serve, weights
    gc.collect()
    return {"ok": True, "seconds": round(time.perf_counter() - started, 3)}


def warmup(request: dict) -> dict:
    """Writes the requests (arrays from an .npz, named "<request index>/<input name>"; request["inputs"]:
    {input name: dtype name}, since .npz stores bfloat16 as 2-byte voids) as PredictionLogs."""
    import numpy as np
    import tensorflow as tf
    from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2

    arrays = np.load(request["requests"])
    os.makedirs(os.path.dirname(request["path"]), exist_ok=True)
    with tf.io.TFRecordWriter(request["path"]) as writer:
        for index in range(request["count"]):
            inputs = {name: arrays[f"{index}/{name}"].view(numpy_dtype(dtype)) for name, dtype in request["inputs"].items()}
            predict = predict_pb2.PredictRequest(
                model_spec=model_pb2.ModelSpec(name=request["model_name"], signature_name=SIGNATURE_NAME),
                inputs={name: tf.make_tensor_proto(array) for name, array in inputs.items()},
            )
            writer.write(prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=predict)).SerializeToString())
    return {"ok": True}


def load_compare_module(path: str):
    """The verify stage's compare.py, loaded from its file without importing the tpuexport package."""
    spec = importlib.util.spec_from_file_location("tpuexport_compare", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run_case(serve, request: dict, case: dict, golden: dict, compare) -> dict:
    """Calls serving_default on one golden case's inputs and compares with its eager outputs.

    Returns:
      The case in report.json's format (label, sizes, passed, error, outputs).
    """
    import numpy as np
    import tensorflow as tf

    tolerances = compare.Tolerances(**request["tolerances"])
    feed = {spec["name"]: tf.constant(golden[case["inputs"][spec["name"]]].astype(numpy_dtype(spec["dtype"]))) for spec in request["inputs"]}
    header = {"label": case["label"], "sizes": case["sizes"]}
    try:
        results = serve(**feed)
    except tf.errors.OpError as error:
        return {**header, "passed": False, "error": " ".join(error.message.split())[:500], "outputs": []}
    outputs = [
        compare.compare_output(name, np.asarray(results[name].numpy()), golden[case["outputs"][name]], tolerances)
        for name in request["outputs"]
    ]
    return {**header, "passed": all(o.passed for o in outputs), "error": None,
            "outputs": [{**dataclasses.asdict(o), "passed": o.passed} for o in outputs]}


def run_out_of_range(serve, request: dict) -> dict:
    """Calls serving_default at sizes outside a dim's range; it must fail with a shape assertion.

    Returns:
      {"sizes", "rejected": whether TF raised the shape-assertion error, "error": its message}.
    """
    import tensorflow as tf

    check = request["out_of_range"]
    feed = {spec["name"]: tf.zeros(check["shapes"][spec["name"]], tf.as_dtype(spec["dtype"])) for spec in request["inputs"]}
    try:
        serve(**feed)
    except tf.errors.InvalidArgumentError as error:
        found = SHAPE_ASSERTION.search(error.message)
        message = found.group(0) if found else " ".join(error.message.split())[:300]
        return {"sizes": check["sizes"], "rejected": found is not None, "error": message}
    return {"sizes": check["sizes"], "rejected": False, "error": None}


def check(request: dict) -> dict:
    import tensorflow as tf

    started = time.perf_counter()
    serve = tf.saved_model.load(request["saved_model"]).signatures[request["signature_name"]]
    loaded = time.perf_counter()
    compare = load_compare_module(request["compare_module"])
    golden = read_safetensors(request["golden"])
    cases = [run_case(serve, request, case, golden, compare) for case in request["cases"]]
    out_of_range = run_out_of_range(serve, request) if request["out_of_range"] else None
    return {
        "ok": True,
        "passed": bool(cases) and all(c["passed"] for c in cases) and (out_of_range is None or out_of_range["rejected"]),
        "cases": cases,
        "out_of_range": out_of_range,
        "tensorflow": tf.__version__,
        "jax_or_torch_loaded": any(sys.modules.get(name) is not None for name in ("jax", "torch")),
        "tf_seconds": {"load": round(loaded - started, 3), "run": round(time.perf_counter() - loaded, 3)},
    }


OPERATIONS = {"load_module": load_module, "build": build, "warmup": warmup, "check": check}


def main() -> None:
    started = time.perf_counter()
    import tensorflow as tf
    from tensorflow.compiler.mlir.stablehlo import stablehlo as tf_stablehlo
    from tensorflow.compiler.tf2xla.python import xla as tfxla

    print(json.dumps({
        "ready": True,
        "tensorflow": tf.__version__,
        "stablehlo_version": tf_stablehlo.get_current_version(),
        "call_module_version": tfxla.call_module_maximum_supported_version(),
        "import_seconds": round(time.perf_counter() - started, 3),
    }), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = OPERATIONS[request["op"]](request)
        except Exception as error:  # reported to the parent, which names the step that failed
            reply = {"ok": False, "error": f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
    # Every reply is flushed and every file closed: leave without TensorFlow's teardown, which the
    # conversion would wait for.
    sys.stdout.flush()
    os._exit(0)
