"""Multimodal models' placeholder tokens: where their image, clip or audio features go in the text.

LLaVA, PaliGemma, Idefics, Qwen2-Audio and the other multimodal models of transformers take token
ids in which a processor wrote one placeholder token per feature of each image (clip, audio clip),
and put the media's features into the text embeddings at those positions. How many there are is
fixed by the model and the media's size, and the model checks it from the tokens' values, which an
exported program cannot (XLA raises no errors). So the count is measured here once, on shapes alone,
the example token ids hold exactly that many, and the signature records it (signature.Placeholder)
for every stage that makes or takes inputs: verification, calibration and warm-up draw rows that
hold it, and the runtime refuses a row that does not.
"""

from __future__ import annotations

import inspect
import logging
import re

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from tpuexport.errors import TpuExportError
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


def count_placeholders(model: torch.nn.Module, examples: dict[str, torch.Tensor]) -> tuple[Placeholder, ...]:
    """The placeholder tokens one row of the model's token input holds for one item of each media
    input, measured on shapes alone (on the meta device with weights there, else with fake tensors).

    Args:
      model: a transformers multimodal model.
      examples: one row of each example input by name; a media input's features method is given
        the media and the other inputs it names (an audio model's input_features_mask).
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
        method_name, keys = _MEDIA[name]
        token = next((getattr(model.config, key) for key in keys if isinstance(getattr(model.config, key, None), int)), None)
        if token is None:
            continue
        # A task head over a multimodal model (ShieldGemma 2's classifier, ModernVBERT's masked LM) leaves it to that model.
        method = next((getattr(owner, method_name) for owner in (model, getattr(model, "base_model", None), *model.children())
                       if hasattr(owner, method_name)), None)
        if method is None:
            raise TpuExportError(f"{type(model).__name__} ({model.config.model_type}) puts {name}'s features into its text at placeholder "
                                 f"tokens but has no {method_name} to count them; convert one tower from a file.py:factory")
        parameters = inspect.signature(method).parameters
        given = {name: example, **{other: value for other, value in examples.items()
                                   if other in parameters and other not in _MEDIA and other != "input_ids"}}
        try:
            features = _shape_only(method, given)
        except Exception as error:  # whatever the model raises on media it does not take this way
            text = " ".join(str(error).split())[:200] or type(error).__name__
            if isinstance(error, (DataDependentOutputException, DynamicOutputShapeException)):
                text = f"how many features it makes depends on its inputs' values: {text}"
            others = [other for other, parameter in parameters.items()
                      if other not in given and parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)]
            required = [other for other in others if parameters[other].default is inspect.Parameter.empty]
            others = required or others  # what it cannot do without, else what it may have wanted
            also = f"; it also takes {', '.join(others)}, which tpuexport does not make" if others else ""
            raise TpuExportError(f"{type(model).__name__} ({model.config.model_type}): its {method_name} fails on {name} of shape "
                                 f"{list(example.shape)} ({text}){also}, so its placeholder tokens cannot be counted; convert one "
                                 "tower from a file.py:factory, or its language model alone with --task text-generation") from None
        placeholders.append(Placeholder(int(token), _rows_of(features), name))
    return tuple(placeholders)


def _shape_only(method, arguments: dict[str, torch.Tensor]):
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = method.__self__
    if any(parameter.is_meta for parameter in model.parameters()):
        from tpuexport.export.capturing import meta_copy

        method = getattr(meta_copy(model), method.__name__)
        arguments = {name: value.to("meta") for name, value in arguments.items()}
    # Fake tensors log the traceback of an operator that fails on them: a failure here is an answer, not news.
    with torch.no_grad(), quiet_loggers(*EXPORT_LOGGERS, level=logging.CRITICAL), FakeTensorMode(allow_non_fake_inputs=True):
        return _feature_tensors(method(**arguments))


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

