"""The language model of a multimodal model, converted alone for `--task text-generation`.

LLaVA, Mistral 3, PaliGemma, Idefics and their kind put image (or audio) features into a causal
language model's text at placeholder tokens; their directories hold one checkpoint of every tower.
Text in, text out, the language model is an ordinary causal LM: the class transformers builds from
the multimodal config's text config (LlamaForCausalLM for LLaVA), whose tensors are the multimodal
model's language-model and LM-head tensors under other names. Those names are found by class in
the multimodal model, built on the meta device: it holds the whole causal LM (BLIP-2), or the causal
LM's base model beside its own LM head (LLaVA); the other towers' tensors are never read.
"""

from __future__ import annotations

import torch

from tpuexport.errors import TpuExportError


def language_model_config(config):
    """A multimodal config's text config when a causal LM of transformers builds it, else None (a
    model whose own type is a causal LM's, an encoder-decoder such as Florence-2's BART, or a text
    config no causal LM class takes: Qwen2-VL's, whose positions are three-dimensional)."""
    from transformers.models.auto import modeling_auto

    if not hasattr(config, "get_text_config") or getattr(config, "is_encoder_decoder", False):
        return None
    text = config.get_text_config(decoder=True)
    causal = text.model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return text if causal and text is not config and not getattr(text, "is_encoder_decoder", False) else None


def multimodal_model(config, dtype: torch.dtype) -> torch.nn.Module:
    """The multimodal model as the directory was saved: the class its config's `architectures` names
    (PP-Chart2Table's is GotOcr2ForConditionalGeneration, over a config class of its own, which the
    auto classes do not map), else transformers' image-text-to-text auto class for the config. Built
    in the caller's device context (the meta device: nothing is allocated)."""
    import transformers

    architectures = list(getattr(config, "architectures", None) or [])
    named = getattr(transformers, architectures[0], None) if architectures else None
    if isinstance(named, type) and issubclass(named, transformers.PreTrainedModel):
        return named._from_config(config, dtype=dtype).eval()
    return transformers.AutoModelForImageTextToText.from_config(config, dtype=dtype).eval()


def language_model_names(multimodal: torch.nn.Module, model: torch.nn.Module) -> dict[str, str]:
    """{each parameter name of the causal LM `model` (tied names too): the multimodal model's name
    of the same tensor}. The multimodal model holds either the whole causal LM (BLIP-2's OPTForCausalLM)
    or its base model (LLaVA's LlamaModel) beside an LM head of its own: found by class, one of each.

    Raises:
      TpuExportError: the multimodal model holds neither once, or has no LM head.
    """
    paths = {}
    for name, module in multimodal.named_modules(remove_duplicate=False):
        paths.setdefault(type(module), []).append(name)
    if len(paths.get(type(model), [])) == 1:
        return {name: f"{paths[type(model)][0]}.{name}" for name, _ in model.named_parameters(remove_duplicate=False)}
    base, head = model.get_decoder(), multimodal.get_output_embeddings()
    if len(paths.get(type(base), [])) != 1 or head is None:
        raise TpuExportError(f"{type(multimodal).__name__} holds no {type(base).__name__} with an LM head to generate text with (a base "
                             "model's directory, or towers of one class); --task text-generation converts the language model of a "
                             "directory written from the model with its head (...ForConditionalGeneration)")
    own = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    head_path = next(name for name, module in multimodal.named_modules(remove_duplicate=False) if module is head)
    prefixes = [(own[id(base)], paths[type(base)][0]), (own[id(model.get_output_embeddings())], head_path)]
    names = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        for own_prefix, multimodal_prefix in prefixes:
            if name.startswith(own_prefix + "."):
                names[name] = multimodal_prefix + name[len(own_prefix):]
    outside = [name for name, _ in model.named_parameters(remove_duplicate=False) if name not in names]
    if outside:
        raise TpuExportError(f"{type(model).__name__} has tensors outside its base model and LM head ({', '.join(outside[:3])}), which "
                             f"{type(multimodal).__name__} does not hold as such; convert one tower from a file.py:factory")
    return names


def tied_names(model: torch.nn.Module) -> dict[str, list[str]]:
    """{each parameter name: every name of that tensor} (an LM head tied to the embeddings has two)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return {name: group for group in groups.values() for name in group}
