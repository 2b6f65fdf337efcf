"""Multimodal models' placeholder tokens: where their image, clip or audio features go in the text.

LLaVA, PaliGemma, Idefics, Qwen2-Audio and the other multimodal models of transformers take token
ids in which a processor wrote one placeholder token per feature of each image (clip, audio clip),
and put the media's features into the text embeddings at those positions. How many there are is
fixed by the model and the media's size, and the model checks it from the tokens' values, which an
exported program cannot (XLA raises no errors). So the count is measured here once, on shapes alone
(the rows of the features the model's forward scatters into its text; else the rows its
get_image_features / get_video_features / get_audio_features gives), the example token ids hold
exactly that many, and the signature records it (signature.Placeholder) for every stage that makes
or takes inputs: verification, calibration and warm-up draw rows that hold it, and the runtime
refuses a row that does not. transformers' checks of tensor values are off while the forward is
traced (capturing.value_checks_off), as the program cannot hold them.
"""

from __future__ import annotations

import inspect
import logging
import re

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.overrides import TorchFunctionMode

from tpuexport.errors import TpuExportError
from tpuexport.export.capturing import value_checks_off
from tpuexport.export.checkpoints import meta_copy
from tpuexport.export.patch_grids import on_cpu_fakes
from tpuexport.logs import EXPORT_LOGGERS, quiet_loggers
from tpuexport.signature import Placeholder

# Each media input, the model method that gives its features, and the config keys of its placeholder token.
_MEDIA = {
    "pixel_values": ("get_image_features", ("image_token_id", "image_token_index")),
    "pixel_values_videos": ("get_video_features", ("video_token_id", "video_token_index")),
    "input_features": ("get_audio_features", ("audio_token_id", "audio_token_index")),
    "input_values": ("get_audio_features", ("audio_token_id", "audio_token_index")),
}
_TOKEN_KEY = re.compile(r"(image|video|audio|vision)_token_(id|index)")


def placeholder_keys(config) -> list[str]:
    """The config's placeholder token fields (image_token_id, audio_token_index, ...)."""
    return [key for key in config.to_dict() if _TOKEN_KEY.fullmatch(key)]


def count_placeholders(model: torch.nn.Module, examples: dict[str, torch.Tensor],
                       constants: dict[str, torch.Tensor] | None = None) -> tuple[Placeholder, ...]:
    """The placeholder tokens one row of the model's token input holds for one item of each media
    input, measured on shapes alone (on the meta device with weights there, else with fake tensors):
    the rows of the features its forward scatters into the text, given that media alone, else the
    rows its features method gives.

    Args:
      model: a transformers multimodal model.
      examples: one row of each example input by name (token ids without placeholders); a features
        method is given the media and the other inputs it names (an audio model's input_features_mask).
      constants: inputs the program fixes (Mistral 3's image_sizes), given alike, their values read.
    Returns:
      One Placeholder per media input whose token the config records.
    Raises:
      TpuExportError: the model has no method giving a media input's features, or it fails on the
        example (one line naming the model and what to do instead).
    """
    placeholders = []
    for name, example in examples.items():
        if name not in _MEDIA:
            continue
        token = next((getattr(model.config, key) for key in _MEDIA[name][1] if isinstance(getattr(model.config, key, None), int)), None)
        if token is None:
            continue
        others = {other: value for other, value in examples.items() if other not in _MEDIA}
        rows = _scattered_rows(model, {**others, name: example}, constants or {})
        placeholders.append(Placeholder(int(token), rows if rows is not None else _feature_rows(model, name, example, others, constants or {}),
                                        name))
    return tuple(placeholders)


def _scattered_rows(model: torch.nn.Module, arguments: dict[str, torch.Tensor], constants: dict[str, torch.Tensor]) -> int | None:
    """The rows of the first features the model's forward scatters into its text embeddings
    (`masked_scatter`, as transformers' multimodal models merge them: BLIP-2's Q-Former queries, not
    its vision tower's patches), run on shapes alone with one item of one media and no placeholder
    token; None when the forward fails so or merges otherwise."""
    scatters = _Scatters()
    try:
        with value_checks_off(), scatters:
            _shape_only(model.forward, arguments, constants)
    except Exception:  # whatever the model raises on inputs it does not take: the features method says more
        return None
    return scatters.rows[0] if scatters.rows else None


class _Scatters(TorchFunctionMode):
    """Records the rows of every `masked_scatter` source, in the width of the embeddings it fills (the
    source may come flattened: LLaVA-NeXT-Video's video features)."""

    def __init__(self):
        super().__init__()
        self.rows: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.masked_scatter:
            source = args[2] if len(args) > 2 else kwargs["source"]
            self.rows.append(source.numel() // args[0].shape[-1])
        return func(*args, **kwargs)


def _feature_rows(model: torch.nn.Module, name: str, example: torch.Tensor, others: dict[str, torch.Tensor],
                  constants: dict[str, torch.Tensor]) -> int:
    """The rows the model's features method (get_image_features, ...) gives for one item of `name`.

    Raises:
      TpuExportError: it has no such method, or the method fails on the example (naming what else it takes).
    """
    method_name = _MEDIA[name][0]
    method = features_method(model, method_name)
    if method is None:
        raise TpuExportError(f"{type(model).__name__} ({model.config.model_type}) puts {name}'s features into its text at placeholder "
                             f"tokens but has no {method_name} to count them; convert one tower from a file.py:factory")
    parameters = inspect.signature(method).parameters
    given = {name: example, **{other: value for other, value in others.items() if other in parameters and other != "input_ids"}}
    try:
        return _rows_of(_feature_tensors(_shape_only(method, given, {other: value for other, value in constants.items() if other in parameters})))
    except Exception as error:  # whatever the model raises on media it does not take this way
        text = " ".join(str(error).split())[:200] or type(error).__name__
        from_values = isinstance(error, (DataDependentOutputException, DynamicOutputShapeException))
        if from_values:
            text = f"how many features it makes depends on its inputs' values: {text}"
        missing = [other for other, parameter in parameters.items()
                   if other not in given and other not in constants and parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)]
        required = [other for other in missing if parameters[other].default is inspect.Parameter.empty]
        missing = required or missing  # what it cannot do without, else what it may have wanted
        also = f"; it also takes {', '.join(missing)}, which tpuexport does not make" if missing else ""
        raise (FeatureCountFromValues if from_values else TpuExportError)(
            f"{type(model).__name__} ({model.config.model_type}): its {method_name} fails on {name} of shape {list(example.shape)} "
            f"({text}){also}, so its placeholder tokens cannot be counted; convert one tower from a file.py:factory, or its "
            "language model alone with --task text-generation") from None


class FeatureCountFromValues(TpuExportError):
    """A features method making as many features as its inputs' values say (an audio encoder's valid
    frames, from its mask), which shapes alone cannot count."""


def features_method(model: torch.nn.Module, method_name: str):
    """The model's `method_name` (get_image_features, ...), or its base model's, or a child's: a task head
    over a multimodal model (ShieldGemma 2's classifier, ModernVBERT's masked LM) leaves it to that
    model. None when none has it."""
    return next((getattr(owner, method_name) for owner in (model, getattr(model, "base_model", None), *model.children())
                 if hasattr(owner, method_name)), None)


def _shape_only(method, arguments: dict[str, torch.Tensor], constants: dict[str, torch.Tensor]):
    """`method(**arguments, **constants)` on shapes alone: on the meta device when the weights are
    there, with fake tensors; with constants (whose values it reads), on fake CPU tensors (on_cpu_fakes)."""
    model = method.__self__
    if constants:
        return on_cpu_fakes(model, method=method.__name__, constants=constants, **arguments)
    if any(parameter.is_meta for parameter in model.parameters()):
        method = getattr(meta_copy(model), method.__name__)
        arguments = {name: value.to("meta") for name, value in arguments.items()}
    # Fake tensors log the traceback of an operator that fails on them: a failure here is an answer, not news.
    with torch.no_grad(), quiet_loggers(*EXPORT_LOGGERS, level=logging.CRITICAL), FakeTensorMode(allow_non_fake_inputs=True):
        return method(**arguments)


def _feature_tensors(output) -> list[torch.Tensor]:
    """The feature tensors a get_*_features returned: transformers 5's output's pooler_output (a
    tensor, or one per image), or the tensor or tuple itself."""
    features = getattr(output, "pooler_output", None)
    features = output if features is None else features
    if isinstance(features, torch.Tensor):
        return [features]
    return [tensor for item in features for tensor in _feature_tensors(item)]


def _rows_of(features: list[torch.Tensor]) -> int:
    """Feature vectors in all: each is one placeholder token (the last axis is the width)."""
    return sum(tensor.numel() // tensor.shape[-1] for tensor in features)

