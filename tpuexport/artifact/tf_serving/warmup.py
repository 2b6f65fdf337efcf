"""TF Serving's warmup file: one PredictRequest per compiled bucket, so a server's first real
request at any bucket's shape does not pay for compilation.

The requests carry the golden inputs of the verification case at the bucket's sizes when there
is one; otherwise random inputs shaped for the bucket that follow the example inputs' values
(verify.make_inputs: token ids stay valid, masks keep their rate of True).
"""

from __future__ import annotations

import pathlib
from typing import Sequence

import numpy as np
import torch

from tpuexport.compile import Bucket
from tpuexport.errors import TpuExportError
from tpuexport.artifact.tf_serving.saved_model import as_artifact_dtype
from tpuexport.signature import ProgramSignature
from tpuexport.verify import VerificationReport, make_inputs


def warmup_inputs(signature: ProgramSignature, verification: VerificationReport, buckets: Sequence[Bucket]) -> list[dict[str, np.ndarray]]:
    """One {input name: array} per distinct bucket, in the artifact's input dtypes.

    Args:
      signature: the program's signature.
      verification: the passed verification report (its golden data; case 0 is always stored).
      buckets: the compiled buckets (several targets may share a bucket; it is warmed up once).
    Returns:
      The request inputs, in bucket order.
    """
    golden_by_sizes = {
        tuple(sorted(case.sizes.items())): index for index, case in enumerate(verification.cases) if case.golden
    }
    examples = [torch.from_numpy(verification.golden[f"0/input/{spec.name}"]) for spec in signature.inputs]
    requests, seen = [], set()
    for seed, bucket in enumerate(buckets):
        key = tuple(sorted(bucket.as_dict().items()))
        if key in seen:
            continue
        seen.add(key)
        if key in golden_by_sizes:
            index = golden_by_sizes[key]
            arrays = [verification.golden[f"{index}/input/{spec.name}"] for spec in signature.inputs]
        else:
            arrays = [t.numpy() for t in make_inputs(signature.inputs, examples, bucket.as_dict(), seed=seed)]
        requests.append({spec.name: as_artifact_dtype(a, spec) for spec, a in zip(signature.inputs, arrays)})
    return requests


def write_warmup_file(tensorflow, path: pathlib.Path, model_name: str, requests: Sequence[dict[str, np.ndarray]],
                      scratch: pathlib.Path) -> None:
    """Has the TensorFlow process write the requests as a TFRecord of PredictionLog protos (TF
    Serving's warmup format).

    Args:
      tensorflow: the TensorFlow process (TensorFlowProcess).
      path: <SavedModel>/assets.extra/tf_serving_warmup_requests.
      model_name: the served model's name (ModelSpec.name).
      requests: {input name: array} per request.
      scratch: a directory for the requests' arrays on their way to the process.
    Raises:
      TpuExportError: TensorFlow could not write the file.
    """
    arrays = scratch / "warmup_requests.npz"
    np.savez(arrays, **{f"{index}/{name}": array for index, inputs in enumerate(requests) for name, array in inputs.items()})
    # .npz keeps bfloat16 arrays as 2-byte voids: their dtype names travel beside them.
    reply = tensorflow.request("warmup", path=str(path), model_name=model_name, requests=str(arrays), count=len(requests),
                               inputs={name: str(array.dtype) for name, array in requests[0].items()} if requests else {})
    if not reply["ok"]:
        raise TpuExportError(f"writing TF Serving's warmup requests failed ({reply['error']}); pass --no-saved-model to skip the SavedModel")
