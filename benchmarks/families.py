"""Tiny random-weight configs of real architectures: the project's yardstick (benchmarks/coverage.py).

Each family builds what a `file.py:factory` returns: {"model", "args", "dynamic_shapes",
"calibration"}, with the model wrapped so that it takes positional tensors and returns a dict of
tensors (no caches). Nothing is downloaded: `transformers` / `diffusers` configs only, random
weights, seeded. Text models get dynamic batch and sequence, vision and audio dynamic batch.

    from families import FAMILIES
    built = FAMILIES["bert"].build()
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 1000
WIDTH = 64
LAYERS = 2
HEADS = 4
BATCH, SEQ = 2, 16
CALIBRATION_SAMPLES = 4


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture.

    Attributes:
      name: short name used on the command line and in the table.
      kind: "encoder", "decoder", "encoder-decoder", "vision", "cnn", "audio", "diffusion" or "pattern".
      build: returns the factory dict.
      fast: part of the pytest subset (small and quick to convert).
    """

    name: str
    kind: str
    build: Callable[[], dict]
    fast: bool = False


class _Outputs(nn.Module):
    """Calls a Hugging Face model with named inputs and returns the named outputs as a dict."""

    def __init__(self, model: nn.Module, input_names: tuple[str, ...], output_names: tuple[str, ...], call_options: dict):
        super().__init__()
        self.model = model.eval()
        self.input_names = input_names
        self.output_names = output_names
        self.call_options = call_options

    def forward(self, *inputs):
        result = self.model(**dict(zip(self.input_names, inputs)), **self.call_options)
        return {name: result[name] for name in self.output_names}


def Outputs(model: nn.Module, input_names: tuple[str, ...], output_names: tuple[str, ...], **call_options) -> nn.Module:
    """A `_Outputs` whose forward declares `input_names` as its parameters, so torch.export (and the
    artifact) name the inputs as the Hugging Face model does."""
    parameters = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ("self", *input_names)]

    def forward(self, *inputs):
        return _Outputs.forward(self, *inputs)

    forward.__signature__ = inspect.Signature(parameters)
    named = type(type(model).__name__ + "Outputs", (_Outputs,), {"forward": forward})
    return named(model, input_names, output_names, call_options)


def _dims(text: bool):
    batch = torch.export.Dim("batch", min=1, max=16)
    seq = torch.export.Dim("seq", min=2, max=128) if text else None
    return batch, seq


def _text(model: nn.Module, outputs: tuple[str, ...], *, mask: bool = True, vocab: int = VOCAB, **call_options) -> dict:
    """A text model: input_ids (and attention_mask), dynamic batch and seq."""
    torch.manual_seed(0)
    batch, seq = _dims(True)
    generator = torch.Generator().manual_seed(1)

    def sample(size_batch, size_seq):
        ids = torch.randint(3, vocab, (size_batch, size_seq), generator=generator)
        return (ids, torch.ones(size_batch, size_seq, dtype=torch.long)) if mask else (ids,)

    args = sample(BATCH, SEQ)
    names = ("input_ids", "attention_mask") if mask else ("input_ids",)
    if mask:
        args[1][1, SEQ - 4:] = 0  # the second sequence is padded
    shapes = {name: {0: batch, 1: seq} for name in names}
    calibration = [sample(4, 32) for _ in range(CALIBRATION_SAMPLES)]
    return {"model": Outputs(model, names, outputs, **call_options), "args": args, "dynamic_shapes": shapes,
            "calibration": calibration}


def _image(model: nn.Module, outputs: tuple[str, ...], size: int = 32, channels: int = 3, input_name: str = "pixel_values") -> dict:
    torch.manual_seed(0)
    batch, _ = _dims(False)
    generator = torch.Generator().manual_seed(1)
    args = (torch.randn(BATCH, channels, size, size, generator=generator),)
    calibration = [(torch.randn(4, channels, size, size, generator=generator),) for _ in range(CALIBRATION_SAMPLES)]
    return {"model": Outputs(model, (input_name,), outputs), "args": args, "dynamic_shapes": {input_name: {0: batch}},
            "calibration": calibration}


def _audio(model: nn.Module, outputs: tuple[str, ...], samples: int = 1600) -> dict:
    torch.manual_seed(0)
    batch, _ = _dims(False)
    generator = torch.Generator().manual_seed(1)
    args = (torch.randn(BATCH, samples, generator=generator),)
    calibration = [(torch.randn(4, samples, generator=generator),) for _ in range(CALIBRATION_SAMPLES)]
    return {"model": Outputs(model, ("input_values",), outputs), "args": args, "dynamic_shapes": {"input_values": {0: batch}},
            "calibration": calibration}


def _hf(config_name: str, model_name: str, **config):
    import transformers

    torch.manual_seed(0)
    return checkpoint_like(getattr(transformers, model_name)(getattr(transformers, config_name)(**config)).eval())


def checkpoint_like(model: nn.Module) -> nn.Module:
    """Gives a freshly initialized model the non-trivial state a trained checkpoint has.

    transformers and diffusers initialize biases to zero and batch norms to mean 0 / variance 1,
    which would hide from verification every mistake in handling a bias or folding a batch norm.
    """
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.05)
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return model


_TEXT = dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
             max_position_embeddings=256)
_DECODER = dict(_TEXT, num_key_value_heads=2, tie_word_embeddings=False)
_VIT = dict(image_size=32, patch_size=8, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            intermediate_size=2 * WIDTH)


def bert():
    return _text(_hf("BertConfig", "BertModel", **_TEXT), ("last_hidden_state", "pooler_output"))


def distilbert():
    config = dict(vocab_size=VOCAB, dim=WIDTH, n_layers=LAYERS, n_heads=HEADS, hidden_dim=2 * WIDTH, max_position_embeddings=256)
    return _text(_hf("DistilBertConfig", "DistilBertModel", **config), ("last_hidden_state",))


def roberta():
    return _text(_hf("RobertaConfig", "RobertaModel", **_TEXT, pad_token_id=1), ("last_hidden_state", "pooler_output"))


def albert():
    config = dict(_TEXT, embedding_size=32)
    return _text(_hf("AlbertConfig", "AlbertModel", **config), ("last_hidden_state", "pooler_output"))


def electra():
    return _text(_hf("ElectraConfig", "ElectraModel", **dict(_TEXT, embedding_size=32)), ("last_hidden_state",))


def deberta_v2():
    config = dict(_TEXT, relative_attention=True, position_buckets=32, pos_att_type=["p2c", "c2p"], max_relative_positions=64)
    return _text(_hf("DebertaV2Config", "DebertaV2Model", **config), ("last_hidden_state",))


def gpt2():
    config = dict(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=256)
    return _text(_hf("GPT2Config", "GPT2LMHeadModel", **config), ("logits",), use_cache=False)


def llama():
    return _text(_hf("LlamaConfig", "LlamaForCausalLM", **_DECODER), ("logits",), use_cache=False)


def qwen2():
    return _text(_hf("Qwen2Config", "Qwen2ForCausalLM", **_DECODER), ("logits",), use_cache=False)


def mistral():
    return _text(_hf("MistralConfig", "MistralForCausalLM", **_DECODER, sliding_window=None), ("logits",), use_cache=False)


def phi3():
    return _text(_hf("Phi3Config", "Phi3ForCausalLM", **_DECODER, pad_token_id=0), ("logits",), use_cache=False)


def gemma():
    return _text(_hf("GemmaConfig", "GemmaForCausalLM", **dict(_DECODER, head_dim=16)), ("logits",), use_cache=False)


def opt():
    config = dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_dim=2 * WIDTH,
                  max_position_embeddings=256, word_embed_proj_dim=WIDTH)
    return _text(_hf("OPTConfig", "OPTForCausalLM", **config), ("logits",), use_cache=False)


def mixtral():
    config = dict(_DECODER, num_local_experts=4, num_experts_per_tok=2)
    return _text(_hf("MixtralConfig", "MixtralForCausalLM", **config), ("logits",), use_cache=False)


def t5():
    config = dict(vocab_size=VOCAB, d_model=WIDTH, d_kv=16, d_ff=2 * WIDTH, num_layers=LAYERS, num_decoder_layers=LAYERS,
                  num_heads=HEADS, relative_attention_num_buckets=16, decoder_start_token_id=0)
    return _seq2seq(_hf("T5Config", "T5Model", **config))


def bart():
    config = dict(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                  decoder_attention_heads=HEADS, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH, max_position_embeddings=256)
    return _seq2seq(_hf("BartConfig", "BartModel", **config))


def _seq2seq(model: nn.Module) -> dict:
    """An encoder-decoder: input_ids, attention_mask and decoder_input_ids share batch; seq is the
    source length, the decoder length is its own dim."""
    built = _text(model, ("last_hidden_state", "encoder_last_hidden_state"), use_cache=False)
    generator = torch.Generator().manual_seed(2)
    decoder = torch.randint(3, VOCAB, (BATCH, 8), generator=generator)
    batch, seq = built["dynamic_shapes"]["input_ids"][0], built["dynamic_shapes"]["input_ids"][1]
    target = torch.export.Dim("target", min=2, max=64)
    built["model"] = Outputs(model, ("input_ids", "attention_mask", "decoder_input_ids"), built["model"].output_names, use_cache=False)
    built["args"] = (*built["args"], decoder)
    built["dynamic_shapes"] = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}, "decoder_input_ids": {0: batch, 1: target}}
    built["calibration"] = [(*sample, torch.randint(3, VOCAB, (4, 8), generator=generator)) for sample in built["calibration"]]
    return built


def whisper():
    config = dict(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                  decoder_attention_heads=HEADS, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH, num_mel_bins=16,
                  max_source_positions=32, max_target_positions=64, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, decoder_start_token_id=1)
    model = _hf("WhisperConfig", "WhisperModel", **config)
    torch.manual_seed(0)
    batch, _ = _dims(False)
    target = torch.export.Dim("target", min=2, max=64)
    generator = torch.Generator().manual_seed(1)

    def sample(size_batch):
        return (torch.randn(size_batch, 16, 64, generator=generator), torch.randint(3, VOCAB, (size_batch, 8), generator=generator))

    return {"model": Outputs(model, ("input_features", "decoder_input_ids"), ("last_hidden_state",), use_cache=False),
            "args": sample(BATCH), "dynamic_shapes": {"input_features": {0: batch}, "decoder_input_ids": {0: batch, 1: target}},
            "calibration": [sample(4) for _ in range(CALIBRATION_SAMPLES)]}


def vit():
    return _image(_hf("ViTConfig", "ViTModel", **_VIT), ("last_hidden_state", "pooler_output"))


def deit():
    return _image(_hf("DeiTConfig", "DeiTModel", **_VIT), ("last_hidden_state",))


def dinov2():
    return _image(_hf("Dinov2Config", "Dinov2Model", **dict(_VIT, mlp_ratio=2)), ("last_hidden_state", "pooler_output"))


def clip_vision():
    return _image(_hf("CLIPVisionConfig", "CLIPVisionModel", **_VIT), ("last_hidden_state", "pooler_output"))


def siglip_vision():
    return _image(_hf("SiglipVisionConfig", "SiglipVisionModel", **_VIT), ("last_hidden_state",))


def swin():
    config = dict(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4)
    return _image(_hf("SwinConfig", "SwinModel", **config), ("last_hidden_state", "pooler_output"))


def convnext():
    config = dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32)
    return _image(_hf("ConvNextConfig", "ConvNextModel", **config), ("last_hidden_state", "pooler_output"))


def resnet():
    config = dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck")
    return _image(_hf("ResNetConfig", "ResNetModel", **config), ("last_hidden_state", "pooler_output"))


def mobilenet_v2():
    config = dict(image_size=32, depth_multiplier=0.35)
    return _image(_hf("MobileNetV2Config", "MobileNetV2Model", **config), ("last_hidden_state", "pooler_output"))


def efficientnet():
    config = dict(image_size=32, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320)
    return _image(_hf("EfficientNetConfig", "EfficientNetModel", **config), ("last_hidden_state", "pooler_output"))


def segformer():
    config = dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                  patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2], decoder_hidden_size=32)
    return _image(_hf("SegformerConfig", "SegformerForSemanticSegmentation", **config), ("logits",))


def wav2vec2():
    config = dict(vocab_size=32, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                  conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                  num_conv_pos_embedding_groups=4, do_stable_layer_norm=False)
    return _audio(_hf("Wav2Vec2Config", "Wav2Vec2Model", **config), ("last_hidden_state",))


def hubert():
    config = dict(vocab_size=32, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                  conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                  num_conv_pos_embedding_groups=4)
    return _audio(_hf("HubertConfig", "HubertModel", **config), ("last_hidden_state",))


def unet2d():
    """A diffusers UNet (down/up blocks with skip connections, time embedding): image side 16."""
    import diffusers

    torch.manual_seed(0)
    model = diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
                                  down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                                  norm_num_groups=8, attention_head_dim=8).eval()
    checkpoint_like(model)
    batch, _ = _dims(False)
    generator = torch.Generator().manual_seed(1)

    def sample(size_batch):
        return torch.randn(size_batch, 3, 16, 16, generator=generator), torch.randint(0, 1000, (size_batch,), generator=generator)

    return {"model": Outputs(model, ("sample", "timestep"), ("sample",)), "args": sample(BATCH),
            "dynamic_shapes": {"sample": {0: batch}, "timestep": {0: batch}}, "calibration": [sample(4) for _ in range(CALIBRATION_SAMPLES)]}


FAMILIES = {family.name: family for family in [
    Family("bert", "encoder", bert, fast=True),
    Family("distilbert", "encoder", distilbert),
    Family("roberta", "encoder", roberta),
    Family("albert", "encoder", albert),
    Family("electra", "encoder", electra),
    Family("deberta-v2", "encoder", deberta_v2),
    Family("gpt2", "decoder", gpt2),
    Family("llama", "decoder", llama, fast=True),
    Family("qwen2", "decoder", qwen2),
    Family("mistral", "decoder", mistral),
    Family("phi3", "decoder", phi3),
    Family("gemma", "decoder", gemma),
    Family("opt", "decoder", opt),
    Family("mixtral", "decoder", mixtral),
    Family("t5", "encoder-decoder", t5),
    Family("bart", "encoder-decoder", bart),
    Family("whisper", "encoder-decoder", whisper),
    Family("vit", "vision", vit, fast=True),
    Family("deit", "vision", deit),
    Family("dinov2", "vision", dinov2),
    Family("clip-vision", "vision", clip_vision),
    Family("siglip-vision", "vision", siglip_vision),
    Family("swin", "vision", swin),
    Family("convnext", "cnn", convnext),
    Family("resnet", "cnn", resnet, fast=True),
    Family("mobilenet-v2", "cnn", mobilenet_v2),
    Family("efficientnet", "cnn", efficientnet),
    Family("segformer", "vision", segformer),
    Family("wav2vec2", "audio", wav2vec2),
    Family("hubert", "audio", hubert),
    Family("unet2d", "diffusion", unet2d),
]}


def as_bf16_checkpoint(family: Family) -> dict:
    """The family as users load a bf16 checkpoint (`from_pretrained(..., dtype=torch.bfloat16)`):
    built under bfloat16 as the default dtype, so parameters and buffers are bfloat16 except what
    the model computes in f32 on purpose (Llama's rotary `inv_freq`); the modules a Hugging Face
    model names in `_keep_in_fp32_modules` back in f32, as from_pretrained keeps them; floating
    inputs in bfloat16. (`model.to(torch.bfloat16)` would also cast the non-persistent f32 buffers,
    which from_pretrained leaves f32.)

    Returns:
      The factory dict, like `family.build()`.
    """
    torch.set_default_dtype(torch.bfloat16)
    try:
        built = family.build()
    finally:
        torch.set_default_dtype(torch.float32)
    for module in built["model"].modules():
        kept = set(getattr(module, "_keep_in_fp32_modules", None) or ())
        for name, submodule in module.named_modules():
            if kept & set(name.split(".")):
                submodule.float()

    def bf16(value):
        return value.to(torch.bfloat16) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    return {**built, "args": tuple(bf16(value) for value in built["args"]),
            "calibration": [tuple(bf16(value) for value in sample) for sample in built["calibration"]]}


# Full-size configs (random weights, nothing downloaded): the depth and width of the checkpoints
# people deploy, for measurements that tiny configs cannot show (rounding that compounds over
# 12-50 layers, conversion time). Too slow for the test suite; used by benchmarks.
def bert_base():
    return _text(_hf("BertConfig", "BertModel"), ("last_hidden_state", "pooler_output"), vocab=30522)


def llama_base():
    """A 12-layer Llama-style decoder (768 wide, grouped-query attention, rotary), about 160M parameters."""
    config = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, max_position_embeddings=2048, tie_word_embeddings=False)
    return _text(_hf("LlamaConfig", "LlamaForCausalLM", **config), ("logits",), vocab=32000, use_cache=False)


def vit_base():
    return _image(_hf("ViTConfig", "ViTModel"), ("last_hidden_state", "pooler_output"), size=224)


def resnet50():
    return _image(_hf("ResNetConfig", "ResNetModel"), ("last_hidden_state", "pooler_output"), size=224)


def swin_tiny():
    return _image(_hf("SwinConfig", "SwinModel"), ("last_hidden_state", "pooler_output"), size=224)


def wav2vec2_base():
    return _audio(_hf("Wav2Vec2Config", "Wav2Vec2Model"), ("last_hidden_state",), samples=16000)


BASE_FAMILIES = {family.name: family for family in [
    Family("bert-base", "encoder", bert_base),
    Family("llama-base", "decoder", llama_base),
    Family("vit-base", "vision", vit_base),
    Family("resnet-50", "cnn", resnet50),
    Family("swin-tiny", "vision", swin_tiny),
    Family("wav2vec2-base", "audio", wav2vec2_base),
]}


def bf16_llama(config: dict, device: str = "cpu"):
    """transformers' LlamaForCausalLM of this config in bfloat16 (random weights, or none on the
    meta device), wrapped to take input_ids and return logits; dims batch 1..64 x seq 2..8192.
    For the large-model benchmarks (slices.py, plan_large.py): built in bfloat16 directly, since a
    float32 copy of a billion-parameter model needs another 4 bytes per parameter.

    Returns:
      (model, example args, dynamic_shapes); the example input is a real (tiny) CPU tensor.
    """
    import transformers

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=2, max=8192)
    args = (torch.randint(0, config["vocab_size"], (2, 64)),)
    return Outputs(model, ("input_ids",), ("logits",), use_cache=False), args, {"input_ids": {0: batch, 1: seq}}
