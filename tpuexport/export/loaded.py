"""What a loaded source is, whatever loaded it (sources.py for files, huggingface.py for Hugging Face
models, the Python API): the model, its example inputs and dims, and where it came from."""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
from typing import Any, Callable

from tpuexport.export.checkpoints import Checkpoint
from tpuexport.signature import Placeholder


@dataclasses.dataclass(frozen=True)
class SourceInfo:
    """Where a model came from, recorded in the manifest.

    Attributes:
      kind: "pt2", "python", "pickle", or "api" for objects handed to `tpuexport.convert`.
      path: the name of the file it was read from (None for "api").
      sha256: hex digest of that file (None for "api").
      reference: the file's name and, for "python" sources, its factory (e.g. "mlp.py:build").
      checkpoint: where the weights were streamed from (its file or directory name), or None when
        the model held them.

    Directories are left out so that converting the same source from another checkout or working
    directory writes the same manifest; the sha256 identifies the file.
    """

    kind: str
    path: str | None = None
    sha256: str | None = None
    reference: str | None = None
    checkpoint: str | None = None


@dataclasses.dataclass(frozen=True)
class LoadedSource:
    """A model ready for `capture`: what the user's source provided, unexported.

    Attributes:
      model: an nn.Module or a torch.export.ExportedProgram.
      args: example positional inputs (None for an ExportedProgram, which carries its own).
      dynamic_shapes: torch.export dynamic_shapes for `args`, or None.
      calibration: an iterable of argument tuples for quantization, or None.
      info: provenance for the manifest.
      input_names: names for the inputs that replace the forward parameter names (from --input).
      checkpoint: the weights to stream (export/checkpoints.py), the model's own parameters then
        typically on the meta device; None when the model holds its weights.
      huggingface: for a Hugging Face source, its export.huggingface.HuggingFaceInfo (task,
        config, revision, tokenizer/processor files for the artifact); None otherwise.
      at_ranges: for dims the source chose itself (a Hugging Face directory's, from its config),
        called with {dim: (min, max)} narrower ranges its model's code takes (min == max: one size it
        fixes): (args, dynamic_shapes, the ranges they are made at), or None when the source does not
        take them (one of those dims is the user's; `capture` then refuses in one line).
      placeholders: a multimodal model's token inputs by name: the placeholder tokens each row holds
        (signature.Placeholder), which the signature records.
    """

    model: Any
    args: tuple | None
    dynamic_shapes: Any
    calibration: Any
    info: SourceInfo
    input_names: tuple[str, ...] | None = None
    checkpoint: Checkpoint | None = None
    huggingface: Any = None
    at_ranges: Callable[[dict[str, tuple[int, int]]], tuple[tuple, Any, dict[str, tuple[int, int]]] | None] | None = None
    placeholders: dict[str, tuple[Placeholder, ...]] = dataclasses.field(default_factory=dict)


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
