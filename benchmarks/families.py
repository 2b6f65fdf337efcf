"""Tiny random-weight configs of real architectures: the project's yardstick (benchmarks/coverage.py).

Each transformers family is a config: its model class, config class and arguments, the Hugging
Face task it converts as, and --dim ranges. `save(directory)` writes it with save_pretrained (what
coverage.py converts with `tpuexport convert DIR --task ...`); `build()` returns what a
`file.py:factory` returns ({"model", "args", "dynamic_shapes", "calibration"}), the model built in
memory and wrapped by tpuexport's own Hugging Face path (export/huggingface.py: inputs named as
the family names them, outputs by field, no caches). Nothing is downloaded: configs only, random
weights, seeded. Text models get dynamic batch and seq, vision and audio dynamic batch.

    from families import FAMILIES
    built = FAMILIES["bert"].build()
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
from typing import Callable

import torch
from torch import nn

VOCAB = 1000
WIDTH = 64
LAYERS = 2
HEADS = 4
CALIBRATION_SAMPLES = 4
CALIBRATION_BATCH = 4
# --dim ranges of the tiny families (the configs' own maxima are larger).
TEXT_DIMS = ("batch=1:16", "seq=2:128")
IMAGE_DIMS = ("batch=1:16",)
AUDIO_DIMS = ("batch=1:16", "samples=1600:1600")


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture.

    Attributes:
      name: short name used on the command line and in the table.
      kind: "encoder", "decoder", "encoder-decoder", "vision", "cnn", "audio", "diffusion" or "pattern".
      build: returns the factory dict.
      fast: part of the pytest subset (small and quick to convert).
      task: the Hugging Face task it converts as (None: not a transformers model).
      save: writes the model as a save_pretrained directory, `save(directory, dtype=torch.float32)`;
        dtype torch.bfloat16 writes a bf16 checkpoint, as most are published (None: not a
        transformers model).
      dims: --dim options of its conversion.
    """

    name: str
    kind: str
    build: Callable[[], dict]
    fast: bool = False
    task: str | None = None
    save: Callable[..., None] | None = None
    dims: tuple[str, ...] = ()


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
    artifact) name the inputs as the Hugging Face model does (for the large-model benchmarks, which
    pick their outputs)."""
    parameters = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ("self", *input_names)]

    def forward(self, *inputs):
        return _Outputs.forward(self, *inputs)

    forward.__signature__ = inspect.Signature(parameters)
    named = type(type(model).__name__ + "Outputs", (_Outputs,), {"forward": forward})
    return named(model, input_names, output_names, call_options)


def transformers_family(name: str, kind: str, model_class: str, config_class: str, config: dict, task: str,
                        dims: tuple[str, ...], fast: bool = False) -> Family:
    """A Family of a transformers model class and config (random weights, seeded, checkpoint_like).

    Args:
      name, kind, fast: as in Family.
      model_class: e.g. "BertModel" (its name is the config's `architectures`, so `--task auto` finds `task`).
      config_class: e.g. "BertConfig"; config: its arguments.
      task: the Hugging Face task.
      dims: --dim options (NAME=MIN:MAX).
    """

    def model() -> nn.Module:
        import transformers

        torch.manual_seed(0)
        return checkpoint_like(getattr(transformers, model_class)(getattr(transformers, config_class)(**config)).eval())

    def build() -> dict:
        from tpuexport.export import parse_dim
        from tpuexport.export.huggingface import forward_program

        wrapped, args, dynamic_shapes = forward_program(model(), [parse_dim(text) for text in dims])
        return {"model": wrapped, "args": args, "dynamic_shapes": dynamic_shapes, "calibration": _calibration(wrapped.input_names, args)}

    def save(directory: pathlib.Path, dtype: torch.dtype = torch.float32) -> None:
        model().to(dtype).save_pretrained(directory)

    return Family(name, kind, build, fast, task, save, dims)


def _calibration(names: tuple[str, ...], args: tuple) -> list[tuple]:
    """Random calibration samples shaped like the example args at a larger batch (token ids within
    the examples' range, attention masks all ones)."""
    generator = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(CALIBRATION_SAMPLES):
        sample = []
        for name, arg in zip(names, args):
            shape = (CALIBRATION_BATCH, *arg.shape[1:])
            if name == "attention_mask":
                sample.append(torch.ones(shape, dtype=arg.dtype))
            elif arg.dtype.is_floating_point:
                sample.append(torch.randn(shape, generator=generator).to(arg.dtype))
            else:
                sample.append(torch.randint(0, int(arg.max()) + 1, shape, generator=generator, dtype=arg.dtype))
        samples.append(tuple(sample))
    return samples


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
_SEQ2SEQ = dict(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                decoder_attention_heads=HEADS, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH)
_AUDIO = dict(vocab_size=32, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
              conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
_SEQ2SEQ_DIMS = (*TEXT_DIMS, "decoder_seq=2:64")
FEATURES, GENERATION = "feature-extraction", "text-generation"

# (name, kind, model class, config class, config, task, dims, fast)
_CONFIGS = [
    ("bert", "encoder", "BertModel", "BertConfig", _TEXT, FEATURES, TEXT_DIMS, True),
    ("distilbert", "encoder", "DistilBertModel", "DistilBertConfig",
     dict(vocab_size=VOCAB, dim=WIDTH, n_layers=LAYERS, n_heads=HEADS, hidden_dim=2 * WIDTH, max_position_embeddings=256),
     FEATURES, TEXT_DIMS, False),
    ("roberta", "encoder", "RobertaModel", "RobertaConfig", dict(_TEXT, pad_token_id=1), FEATURES, TEXT_DIMS, False),
    ("albert", "encoder", "AlbertModel", "AlbertConfig", dict(_TEXT, embedding_size=32), FEATURES, TEXT_DIMS, False),
    ("electra", "encoder", "ElectraModel", "ElectraConfig", dict(_TEXT, embedding_size=32), FEATURES, TEXT_DIMS, False),
    ("deberta-v2", "encoder", "DebertaV2Model", "DebertaV2Config",
     dict(_TEXT, relative_attention=True, position_buckets=32, pos_att_type=["p2c", "c2p"], max_relative_positions=64),
     FEATURES, TEXT_DIMS, False),
    ("gpt2", "decoder", "GPT2LMHeadModel", "GPT2Config", dict(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=256),
     GENERATION, TEXT_DIMS, False),
    ("llama", "decoder", "LlamaForCausalLM", "LlamaConfig", _DECODER, GENERATION, TEXT_DIMS, True),
    ("qwen2", "decoder", "Qwen2ForCausalLM", "Qwen2Config", _DECODER, GENERATION, TEXT_DIMS, False),
    ("mistral", "decoder", "MistralForCausalLM", "MistralConfig", dict(_DECODER, sliding_window=None), GENERATION, TEXT_DIMS, False),
    # Mistral with its sliding window (8 positions, shorter than the generation rows' 64-position
    # context): the KV cache is bounded by the window, a ring of 8 positions per slot.
    ("mistral-window", "decoder", "MistralForCausalLM", "MistralConfig", dict(_DECODER, sliding_window=8), GENERATION, TEXT_DIMS, False),
    ("phi3", "decoder", "Phi3ForCausalLM", "Phi3Config", dict(_DECODER, pad_token_id=0), GENERATION, TEXT_DIMS, False),
    ("gemma", "decoder", "GemmaForCausalLM", "GemmaConfig", dict(_DECODER, head_dim=16), GENERATION, TEXT_DIMS, False),
    ("opt", "decoder", "OPTForCausalLM", "OPTConfig",
     dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_dim=2 * WIDTH,
          max_position_embeddings=256, word_embed_proj_dim=WIDTH), GENERATION, TEXT_DIMS, False),
    ("mixtral", "decoder", "MixtralForCausalLM", "MixtralConfig", dict(_DECODER, num_local_experts=4, num_experts_per_tok=2),
     GENERATION, TEXT_DIMS, False),
    ("t5", "encoder-decoder", "T5Model", "T5Config",
     dict(vocab_size=VOCAB, d_model=WIDTH, d_kv=16, d_ff=2 * WIDTH, num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
          relative_attention_num_buckets=16, decoder_start_token_id=0), FEATURES, _SEQ2SEQ_DIMS, False),
    ("bart", "encoder-decoder", "BartModel", "BartConfig", dict(_SEQ2SEQ, max_position_embeddings=256), FEATURES, _SEQ2SEQ_DIMS, False),
    ("whisper", "encoder-decoder", "WhisperModel", "WhisperConfig",
     dict(_SEQ2SEQ, num_mel_bins=16, max_source_positions=32, max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
          decoder_start_token_id=1), FEATURES, ("batch=1:16", "decoder_seq=2:64"), False),
    ("vit", "vision", "ViTModel", "ViTConfig", _VIT, FEATURES, IMAGE_DIMS, True),
    ("deit", "vision", "DeiTModel", "DeiTConfig", _VIT, FEATURES, IMAGE_DIMS, False),
    ("dinov2", "vision", "Dinov2Model", "Dinov2Config", dict(_VIT, mlp_ratio=2), FEATURES, IMAGE_DIMS, False),
    ("clip-vision", "vision", "CLIPVisionModel", "CLIPVisionConfig", _VIT, FEATURES, IMAGE_DIMS, False),
    ("siglip-vision", "vision", "SiglipVisionModel", "SiglipVisionConfig", _VIT, FEATURES, IMAGE_DIMS, False),
    ("swin", "vision", "SwinModel", "SwinConfig",
     dict(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4), FEATURES, IMAGE_DIMS, False),
    ("convnext", "cnn", "ConvNextModel", "ConvNextConfig", dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32),
     FEATURES, IMAGE_DIMS, False),
    ("resnet", "cnn", "ResNetModel", "ResNetConfig",
     dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck", image_size=32), FEATURES, IMAGE_DIMS, True),
    ("mobilenet-v2", "cnn", "MobileNetV2Model", "MobileNetV2Config", dict(image_size=32, depth_multiplier=0.35), FEATURES, IMAGE_DIMS, False),
    ("efficientnet", "cnn", "EfficientNetModel", "EfficientNetConfig",
     dict(image_size=32, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320), FEATURES, IMAGE_DIMS, False),
    ("segformer", "vision", "SegformerForSemanticSegmentation", "SegformerConfig",
     dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2], patch_sizes=[7, 3],
          strides=[4, 2], mlp_ratios=[2, 2], decoder_hidden_size=32, image_size=32), "semantic-segmentation", IMAGE_DIMS, False),
    ("wav2vec2", "audio", "Wav2Vec2Model", "Wav2Vec2Config", dict(_AUDIO, do_stable_layer_norm=False), FEATURES, AUDIO_DIMS, False),
    ("hubert", "audio", "HubertModel", "HubertConfig", _AUDIO, FEATURES, AUDIO_DIMS, False),
]


def unet2d():
    """A diffusers UNet (down/up blocks with skip connections, time embedding): image side 16."""
    import diffusers

    torch.manual_seed(0)
    model = diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
                                  down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                                  norm_num_groups=8, attention_head_dim=8).eval()
    checkpoint_like(model)
    batch = torch.export.Dim("batch", min=1, max=16)
    generator = torch.Generator().manual_seed(1)

    def sample(size_batch):
        return torch.randn(size_batch, 3, 16, 16, generator=generator), torch.randint(0, 1000, (size_batch,), generator=generator)

    return {"model": Outputs(model, ("sample", "timestep"), ("sample",)), "args": sample(2),
            "dynamic_shapes": {"sample": {0: batch}, "timestep": {0: batch}},
            "calibration": [sample(CALIBRATION_BATCH) for _ in range(CALIBRATION_SAMPLES)]}


FAMILIES = {family.name: family for family in [
    *(transformers_family(*entry) for entry in _CONFIGS),
    Family("unet2d", "diffusion", unet2d),
]}


# Full-size configs (random weights, nothing downloaded): the depth and width of the checkpoints
# people deploy, for measurements that tiny configs cannot show (rounding that compounds over
# 12-50 layers, conversion time). Too slow for the test suite; used by benchmarks.
BASE_FAMILIES = {family.name: family for family in [
    transformers_family("bert-base", "encoder", "BertModel", "BertConfig", {}, FEATURES, TEXT_DIMS),
    # A 12-layer Llama-style decoder (768 wide, grouped-query attention, rotary), about 160M parameters.
    transformers_family("llama-base", "decoder", "LlamaForCausalLM", "LlamaConfig",
                        dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                             intermediate_size=2048, max_position_embeddings=2048, tie_word_embeddings=False), GENERATION, TEXT_DIMS),
    transformers_family("vit-base", "vision", "ViTModel", "ViTConfig", {}, FEATURES, IMAGE_DIMS),
    transformers_family("resnet-50", "cnn", "ResNetModel", "ResNetConfig", {}, FEATURES, IMAGE_DIMS),
    transformers_family("swin-tiny", "vision", "SwinModel", "SwinConfig", {}, FEATURES, IMAGE_DIMS),
    transformers_family("wav2vec2-base", "audio", "Wav2Vec2Model", "Wav2Vec2Config", {}, FEATURES, ("batch=1:16", "samples=16000:16000")),
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

    return bf16_causal_lm(transformers.LlamaForCausalLM, transformers.LlamaConfig(**config), device, max_seq=8192)


def bf16_causal_lm(model_class, config, device: str, max_seq: int):
    """A transformers causal LM of `config` built in bfloat16 on `device`, wrapped to take
    input_ids and return logits; dims batch 1..64 x seq 2..max_seq; example input [2, 64].

    Returns:
      (model, example args, dynamic_shapes).
    """
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = model_class(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=2, max=max_seq)
    args = (torch.randint(0, config.vocab_size, (2, 64)),)
    return Outputs(model, ("input_ids",), ("logits",), use_cache=False), args, {"input_ids": {0: batch, 1: seq}}
