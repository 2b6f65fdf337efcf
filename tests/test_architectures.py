"""Classes of architectures found by the breadth sweep (benchmarks/architectures.py): one tiny model
per class that tpuexport converts, or refuses in one line, where it once crashed or mismatched."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import requests
import safetensors.torch
import torch

import tpuexport
from conftest import served
from test_cli import tpuexport_in_process  # the command line, in this process
from tpuexport import TpuExportError

transformers = pytest.importorskip("transformers")

# Bounded dims and no optional verification sizes: each conversion takes seconds.
QUICK = ("--target", "v5e", "--no-saved-model", "--verify-budget", "0")


def convert_directory(directory: pathlib.Path, out: pathlib.Path, *options: str) -> subprocess.CompletedProcess:
    """`tpuexport convert DIR --task auto` as a user runs it, in its own process: what torch logs on the
    process's stderr reaches the user too (elsewhere the command runs in this process, tpuexport_in_process)."""
    environment = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    return subprocess.run([sys.executable, "-m", "tpuexport.cli", "convert", str(directory), "-o", str(out), *options],
                          capture_output=True, text=True, timeout=900, env=environment)


def error_lines(stderr: str) -> list[str]:
    """What tpuexport printed after its progress lines (libraries' import-time lines left out)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.lstrip().startswith("✓")
            and not line.startswith(("Failed to load", "W1"))]


def test_a_bidirectional_decoder_is_refused_for_text_generation(tmp_path):
    """A BERT-style causal LM head built with is_decoder false attends both ways: generate()
    recomputes every position at each step, which a KV cache cannot do. It verified within 1 of
    4096 logits of passing (a near-silent mismatch); now it is refused before any work."""
    config = transformers.BertGenerationConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                               intermediate_size=64, is_decoder=False)
    model = transformers.BertGenerationDecoder(config).eval()
    with pytest.raises(TpuExportError, match="BertGenerationDecoder attends bidirectionally .* set is_decoder true"):
        tpuexport.convert(model, task="text-generation", max_context=16, out=tmp_path / "lm.tpu")
    assert list(tmp_path.iterdir()) == []


def test_a_decoder_seeing_its_prompt_whole_is_refused_naming_the_field_that_says_so(tmp_path):
    """PaliGemma's Gemma sees its prompt (a prefix) whole: its config says so with
    use_bidirectional_attention, not is_decoder, which the line named ("set is_decoder true")."""
    config = transformers.GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=1, head_dim=8, use_bidirectional_attention=True)
    with pytest.raises(TpuExportError, match=r"GemmaForCausalLM attends bidirectionally \(its config's use_bidirectional_attention is "
                                             r"true\), .* set use_bidirectional_attention false in config.json"):
        tpuexport.convert(transformers.GemmaForCausalLM(config).eval(), task="text-generation", max_context=16, out=tmp_path / "lm.tpu")
    assert list(tmp_path.iterdir()) == []


def test_a_forward_torch_export_cannot_trace_is_one_line_naming_the_architecture(tmp_path):
    """torch's fake tensors log the traceback of an operator that fails on them before torch.export
    raises; the user sees only tpuexport's line, which names the architecture."""
    config = transformers.Ernie4_5_MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, moe_num_experts=4,
                                            moe_k=6, max_position_embeddings=32)  # more experts per token than experts
    transformers.Ernie4_5_MoeForCausalLM(config).save_pretrained(tmp_path / "moe")
    result = convert_directory(tmp_path / "moe", tmp_path / "moe.tpu", *QUICK)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    # Eager PyTorch fails alike on these inputs (on fake tensors, as torch.export traces): the model's own forward is named.
    assert error_lines(result.stderr) == ["error: the model's own forward fails on Ernie4_5_MoeForCausalLM (ernie4_5_moe) at the example "
                                          "sizes ([1, 32], [1], [1], [2, 1, 2, 32, 8], [2, 1, 2, 32, 8]), run without torch.export: k not in "
                                          "range for dimension; these inputs do not suit it (it may take others, or other sizes): give them "
                                          "with --dim, or its own inputs from a file.py:factory"]
    assert not (tmp_path / "moe.tpu").exists()


class ConstantOnTheWeightsDevice(torch.nn.Module):
    """Makes a tensor constant in its forward on its weights' device, as Mask2Former's deformable
    attention does (its offset normalizer)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        scale = torch.tensor([2.0, 0.5] * 4, device=self.linear.weight.device)
        return self.linear(x) * scale


def test_constants_made_on_the_weights_device_get_values_when_weights_stream(tmp_path):
    """Exported on the meta device (weights streamed from a checkpoint), such a constant had no value
    and the conversion was refused; it is exported again with the checkpoint's tensors."""
    torch.manual_seed(0)
    model = ConstantOnTheWeightsDevice().eval()
    safetensors.torch.save_file(model.state_dict(), str(tmp_path / "weights.safetensors"))
    with tpuexport.parameters_on_meta():
        on_meta = ConstantOnTheWeightsDevice().eval()
    x = torch.randn(3, 8)
    artifact = tpuexport.convert(on_meta, (x,), {"x": {0: torch.export.Dim("batch", min=1, max=8)}}, checkpoint=tmp_path / "weights.safetensors",
                                 saved_model=False, out=tmp_path / "model.tpu")
    assert artifact.manifest["verification"]["passed"]
    torch.testing.assert_close(artifact.run(x), model(x), rtol=1e-2, atol=1e-3)


def test_a_decoder_without_a_position_table_defaults_its_context_as_vllm_does():
    """BLOOM's ALiBi and Mamba's recurrent state take any length and their configs record none: 2048
    positions by default (Mamba's one prefill bucket that long: its selective scan is one loop,
    tests/test_recurrent_state.py)."""
    from tpuexport.export.huggingface import UNRECORDED_CONTEXT, generation_context

    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)).eval()
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=8)).eval()
    assert generation_context(bloom) == generation_context(mamba) == UNRECORDED_CONTEXT == 2048


def test_a_multimodal_forward_takes_the_placeholder_tokens_its_processor_writes_and_refuses_other_counts(tmp_path):
    """A vision-language model's forward puts each image's features into its text at image tokens,
    as many as the image has features (16 here), which it checks from the tokens' values: the count
    is measured at conversion and recorded in the signature, verification draws rows that hold it,
    and the runner and Artifact.run refuse a row that does not (XLA cannot raise on values: the
    program would silently give that row another row's features). It was refused before."""
    config = transformers.LlavaConfig(
        text_config={"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "max_position_embeddings": 32},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "projection_dim": 32},
        image_token_index=63)
    torch.manual_seed(0)
    model = transformers.LlavaModel(config).eval()
    model.save_pretrained(tmp_path / "llava")
    result = tpuexport_in_process("convert", tmp_path / "llava", "-o", tmp_path / "llava.tpu", *QUICK, "--target", "cpu",
                                  "--bucket", "seq=20")
    assert result.returncode == 0, result.stderr[-2000:]
    artifact = tpuexport.load(tmp_path / "llava.tpu")
    input_ids = next(spec for spec in artifact.signature.inputs if spec.name == "input_ids")
    assert input_ids.placeholders == (tpuexport.signature.Placeholder(63, 16, "pixel_values"),)
    assert artifact.signature.dim("seq").min == 17  # the image's tokens and one of text
    shown = tpuexport_in_process("inspect", tmp_path / "llava.tpu").stdout
    assert "input input_ids: int32[1, seq]; each row holds 16 x token 63 for pixel_values" in shown, shown

    ids = torch.randint(0, 63, (1, 20))
    ids[0, 2:18] = 63  # a prompt, the image's 16 tokens, more prompt
    pixel_values = torch.randn(1, 3, 32, 32)
    mask = torch.ones(1, 20, dtype=torch.long)
    order = [spec.name for spec in artifact.signature.inputs]
    named = {"input_ids": ids, "pixel_values": pixel_values, "attention_mask": mask}
    with torch.no_grad():
        expected = model(**named).last_hidden_state
    outputs = artifact.run(*(named[name] for name in order))
    torch.testing.assert_close(outputs["last_hidden_state"], expected, atol=1e-4, rtol=1e-4)
    runner = tpuexport.runner(tmp_path / "llava.tpu", target="cpu")
    answered = runner.run({name: value.numpy() for name, value in named.items()})
    np.testing.assert_allclose(answered["last_hidden_state"], expected.numpy(), atol=1e-4, rtol=1e-4)

    short = ids.clone()
    short[0, 2] = 5  # 15 image tokens: eager PyTorch raises; the program would not
    message = ("input_ids row 0 holds 15 placeholder tokens 63 (where pixel_values's features go); the model takes exactly 16 "
               "per row, as its processor writes them")
    with pytest.raises(TpuExportError) as refused:
        artifact.run(*({**named, "input_ids": short}[name] for name in order))
    assert str(refused.value) == message
    with pytest.raises(TpuExportError) as refused:
        runner.run({**{name: value.numpy() for name, value in named.items()}, "input_ids": short.numpy()})
    assert str(refused.value) == message

    with served(tmp_path / "llava.tpu", tmp_path / "server.log") as rest:
        predict = f"{rest}/v1/models/llava:predict"
        answer = requests.post(predict, json={"inputs": {name: value.tolist() for name, value in named.items()}}, timeout=60)
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(np.array(answer.json()["outputs"]), expected.numpy(), atol=1e-4, rtol=1e-4)
        refused = requests.post(predict, json={"inputs": {**{name: value.tolist() for name, value in named.items()},
                                                          "input_ids": short.tolist()}}, timeout=60)
        assert refused.status_code == 400 and message in refused.json()["error"], refused.text
        assert requests.post(predict, json={"inputs": {name: value.tolist() for name, value in named.items()}}, timeout=60).ok


def test_a_multimodal_model_whose_image_fills_its_context_is_refused_in_one_line(tmp_path):
    """Qwen2-VL's 224 x 224 image of 8-pixel patches merged 2 x 2 is 196 placeholder tokens, more than its
    64 positions hold: one line says so and how to convert it (smaller images; at 32 x 32 it converts,
    tests/test_patch_grids.py)."""
    config = transformers.Qwen2VLConfig(
        text_config={"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "max_position_embeddings": 64,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 4, "patch_size": 8, "spatial_merge_size": 2},
        image_token_id=63, video_token_id=62, vision_start_token_id=61)
    transformers.Qwen2VLModel(config).save_pretrained(tmp_path / "qwen2_vl")
    result = tpuexport_in_process("convert", tmp_path / "qwen2_vl", "-o", tmp_path / "qwen2_vl.tpu", *QUICK)
    assert result.returncode == 2 and error_lines(result.stderr) == [
        "error: Qwen2VLModel (qwen2_vl) takes at most 64 tokens but one row holds 196 placeholder tokens for its media's features; "
        "no sequence fits; give smaller images (--dim height=H:H --dim width=W:W)"], result.stderr[-2000:]
    assert not (tmp_path / "qwen2_vl.tpu").exists()


class LoopOverChosenRows(torch.nn.Module):
    """A Python loop over the rows a comparison picks (as transformers' eager experts loop over the
    experts tokens chose): torch.export cannot trace it."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        out = torch.zeros_like(x)
        for row in (x.sum(-1) > 0).nonzero():
            out = out + self.linear(x[row])
        return out


def test_data_dependent_control_flow_is_one_line_without_torchs_graph_dump(tmp_path, capfd):
    """torch.export prints the partial graph of such a trace to stderr (hundreds of lines for a real
    model) before raising; only tpuexport's line remains, saying what the model does."""
    with pytest.raises(TpuExportError, match="its forward branches on tensor values .* needs tensor ops or torch.cond"):
        tpuexport.convert(LoopOverChosenRows(), (torch.randn(3, 4),), out=tmp_path / "m.tpu")
    assert "def forward" not in capfd.readouterr().err


class SplitByCounts(torch.nn.Module):
    """Rows split into groups whose sizes are counts read from the input (as JetMoE's experts take
    the tokens routed to each): sizes torch.export names by symbols of its own (u0, ...)."""

    def forward(self, x, groups):
        counts = torch.zeros(x.shape[0], 2).scatter(1, groups[:, None], 1).long().sum(0).tolist()
        first, second = x[groups.argsort()].split(counts, dim=0)
        return torch.cat([first * 2, second * 3])


def test_a_size_made_from_tensor_values_is_one_line_naming_the_code(tmp_path):
    """JetMoE was refused with "dim u0 appears only in expressions of several dims": a symbol the
    user never declared. The line now says what the code does, and where."""
    with pytest.raises(TpuExportError, match=r"its code sizes a tensor by tensor values, at .*test_architectures.py:\d+ "
                                             r"\(first, second = x\[groups.argsort\(\)\].split\(counts, dim=0\)\).* needs fixed-size tensor ops"):
        tpuexport.convert(SplitByCounts(), (torch.randn(4, 2), torch.tensor([0, 1, 1, 0])), out=tmp_path / "m.tpu")
    assert list(tmp_path.iterdir()) == []


class PadsFromScalarBuffers(torch.nn.Module):
    """Pads its input for a strided convolution by an amount computed from integer scalar buffers it
    keeps out of its checkpoint, as EnCodec's, Mimi's and Pocket TTS's convolutions do."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 4, kernel_size=4, stride=2)
        self.stride = torch.nn.Buffer(torch.tensor(2), persistent=False)
        self.kernel_size = torch.nn.Buffer(torch.tensor(4), persistent=False)

    def forward(self, x):
        frames = torch.ceil((x.shape[-1] - self.kernel_size) / self.stride + 1).to(torch.int64) - 1
        return self.conv(torch.nn.functional.pad(x, (0, frames * self.stride + self.kernel_size - x.shape[-1])))


def test_sizes_computed_from_a_models_scalar_constants_export_as_numbers(tmp_path):
    """torch.export lifts buffers to program inputs whose values it does not know: the padding
    EnCodec, Mimi, Pocket TTS's and WavTokenizer's encoders compute from their stride and kernel size
    buffers was a size from tensor values, refused ("its forward branches on tensor values"). Such
    buffers (integer scalars, not in the checkpoint) are read as numbers while exporting; the model
    keeps them as they were."""
    model = PadsFromScalarBuffers().eval()
    artifact = tpuexport.convert(model, (torch.randn(2, 1, 17),), target="cpu", saved_model=False, out=tmp_path / "m.tpu")
    x = torch.randn(2, 1, 17)
    torch.testing.assert_close(artifact.run(x), model(x), rtol=1e-2, atol=1e-3)
    assert type(model) is PadsFromScalarBuffers and [name for name, _ in model.named_buffers()] == ["stride", "kernel_size"]


class NearestCodes(torch.nn.Module):
    """Distances of every frame of every row to a codebook with torch.cdist, as Mimi's quantizer: cdist
    takes another path past 25 vectors, which bounds batch x 9 frames by 25."""

    def __init__(self):
        super().__init__()
        self.codebook = torch.nn.Parameter(torch.randn(16, 4))

    def forward(self, x):
        return torch.cdist(x.reshape(-1, 4)[None], self.codebook[None])[0].argmin(-1)


def test_a_bound_torch_export_fails_to_report_is_one_line_naming_the_range(tmp_path):
    """torch.export's report of the bound (batch <= 25/9) fails in its own prettify_results ("Expected op
    to be '==', got <= for batch <= 25/9"), which Mimi was refused with; the line names the range that
    converts, as for any bound the code puts on a dim (a directory's dims are narrowed to it: Mimi
    converts at batch 1..2)."""
    batch = torch.export.Dim("batch", min=1, max=8)
    with pytest.raises(TpuExportError, match=r"the model's code needs batch in 1\.\.2, at .*test_architectures.py:\d+ .*--dim batch=1:2"):
        tpuexport.convert(NearestCodes().eval(), (torch.randn(2, 9, 4),), {"x": {0: batch}}, out=tmp_path / "m.tpu")
    assert list(tmp_path.iterdir()) == []


def test_a_mixture_of_experts_that_defaults_to_eager_experts_exports_with_grouped_ones(tmp_path):
    """The OpenAI privacy filter defaults to transformers' eager experts (a loop over the experts
    tokens chose, refused as above); its directory converts with the grouped-matmul experts."""
    from tpuexport.export import capture, load_source

    config = transformers.OpenAIPrivacyFilterConfig(vocab_size=64, pad_token_id=0, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                                    num_experts_per_tok=2, max_position_embeddings=32, num_labels=3)
    transformers.OpenAIPrivacyFilterForTokenClassification(config).save_pretrained(tmp_path / "filter")
    captured = capture(load_source(str(tmp_path / "filter")))
    assert captured.reference.model.config._experts_implementation == "grouped_mm"
    assert [spec.name for spec in captured.signature.outputs] == ["logits"]


def test_a_row_sees_the_causal_mask_it_is_given_whether_or_not_its_batch_is_padded():
    """AIMv2's text attention hard-codes is_causal=False beside a causal mask, and transformers'
    SDPA path drops an all-ones mask eagerly (never under torch.export): an unpadded batch ran
    bidirectionally and failed verification at batch 1 x seq 2 (relative RMS 0.43). The forward
    tpuexport exports and verifies against gives a row the same output alone or beside a padded row."""
    from tpuexport.export.huggingface import named_forward

    config = transformers.Aimv2TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, max_position_embeddings=16, eos_token_id=63)
    forward = named_forward(transformers.Aimv2TextModel(config).eval(), ("input_ids", "attention_mask"))
    ids = torch.tensor([[5, 7, 9, 63], [3, 4, 63, 0]])
    with torch.no_grad():
        alone = forward(ids[:1], torch.ones(1, 4, dtype=torch.long))["last_hidden_state"]
        beside_padded = forward(ids, torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]))["last_hidden_state"][:1]
    torch.testing.assert_close(alone, beside_padded)


def test_probing_a_model_on_the_meta_device_keeps_the_buffers_its_init_computed():
    """CTRL's forward keeps `self.pos_encoding.to(device)`: the KV-cache shape probe, run on the
    meta device, left a meta tensor where the model's init had computed its sinusoidal table
    (a non-persistent buffer no checkpoint holds), and the directory was refused for lacking it."""
    from tpuexport.export.checkpoints import parameters_on_meta
    from tpuexport.export.generation import cached_shapes

    config = transformers.CTRLConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4, dff=64, n_positions=16)
    with parameters_on_meta():
        model = transformers.CTRLLMHeadModel(config).eval()
    table = model.transformer.pos_encoding.clone()
    assert cached_shapes(model) == (4, 8)
    assert not model.transformer.pos_encoding.is_meta
    torch.testing.assert_close(model.transformer.pos_encoding, table)


def test_a_config_class_transformers_lists_under_an_alias_still_builds_its_model():
    """transformers' config mapping lists EvollaConfig under "evolla" and under "EvollaModel", so
    its auto classes look the config class up as the alias, which no model table lists:
    AutoModel.from_config refused an EvollaConfig and the conversion crashed with its 400-name
    message. The model-type table's class is built."""
    from tpuexport.export.huggingface import auto_model_class

    config = transformers.EvollaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=64, architectures=["EvollaModel"])
    with torch.device("meta"):
        model = auto_model_class("AutoModel", config).from_config(config)
    assert type(model) is transformers.EvollaModel


def test_an_audio_encoder_that_reads_its_frame_mask_is_given_one():
    """AudioFlamingo3's encoder sums `input_features_mask` whatever its signature's default (None):
    given input_features alone, torch.export failed with "'NoneType' object has no attribute
    'sum'". Audio encoders whose forward takes a frame mask get one, every frame marked audio."""
    from tpuexport.export.huggingface import forward_program

    config = transformers.AudioFlamingo3EncoderConfig(num_mel_bins=16, d_model=32, encoder_layers=1, encoder_attention_heads=4,
                                                      encoder_ffn_dim=64, max_source_positions=8)
    model = transformers.AudioFlamingo3Encoder(config).eval()
    wrapped, args, dynamic_shapes = forward_program(model)
    assert wrapped.input_names == ("input_features", "input_features_mask")
    assert args[1].shape == (args[0].shape[0], 16) and bool(args[1].all())
    with torch.no_grad():
        assert wrapped(*args)["last_hidden_state"].shape == (args[0].shape[0], 4, 32)


class TakesImagesPerSample(torch.nn.Module):
    """Reads pixel values as [batch, images, channels, height, width] (as IDEFICS does), so a
    4-d batch of images fails in its own Python before any tracing matters."""

    def forward(self, pixel_values):
        batch, images, channels, height, width = pixel_values.shape
        return pixel_values.reshape(batch * images, channels, height * width).mean(-1)


def test_inputs_the_model_itself_cannot_take_are_refused_as_such_with_their_sizes(tmp_path):
    """IDEFICS was refused with "torch.export failed on IdeficsModel: not enough values to unpack
    (expected 4, got 3)", as if tracing were to blame. The forward fails the same way run eagerly:
    the line says so, with the sizes it was given."""
    with pytest.raises(TpuExportError, match=r"^the model's own forward fails at the example sizes \(\[2, 3, 8, 8\]\), run without "
                                             r"torch.export: not enough values to unpack \(expected 5, got 4\); these inputs do not suit it"):
        tpuexport.convert(TakesImagesPerSample(), (torch.randn(2, 3, 8, 8),), out=tmp_path / "m.tpu")
    assert list(tmp_path.iterdir()) == []


class SplitsMoreThanItHas(torch.nn.Module):
    """Splits its last dim into sizes that add up to more than it holds (a tiny GLM-4V MoE text model's
    rotary sections, [2, 3, 3] of 4)."""

    def forward(self, x):
        return torch.split(x, [2, 3, 3], dim=-1)[0]


def test_a_forward_failing_eagerly_in_other_words_than_torch_export_is_refused_as_the_models_own(tmp_path):
    """torch.export says "Split sizes add up to 8 but got the tensor's size of 4", the kernel run eagerly
    "split_with_sizes expects split_sizes to sum exactly to 4": the messages differ, and the line was
    "torch.export failed ... check the example args" (the sweep's glm4v_moe_text, fun_asr_nano_encoder,
    clvp). The forward fails without torch.export: the line says so."""
    with pytest.raises(TpuExportError, match=r"^the model's own forward fails at the example sizes \(\[2, 4\]\), run without "
                                             r"torch.export: RuntimeError: split_with_sizes expects split_sizes to sum exactly to 4"):
        tpuexport.convert(SplitsMoreThanItHas(), (torch.randn(2, 4),), out=tmp_path / "m.tpu")
    assert list(tmp_path.iterdir()) == []


class ShiftsByOne(torch.nn.Module):
    """Pairs each position with the next, zero-padded, and branches on one sequence length, as
    MobileBERT's trigram embedding makes torch.export guard `seq - 1 != 1`."""

    def forward(self, x):
        if x.shape[1] - 1 == 1:
            return x * 2
        return x + torch.nn.functional.pad(x[:, 1:], [0, 1])


def test_a_size_the_models_code_rules_out_names_it_and_a_range_without_it(tmp_path):
    """A guard `EXPR != k` has no suggested fix in torch.export's message: MobileBERT was refused
    with torch's raw "Constraints violated (seq)! ... satisfy the generated guard ((-1) + L['input_ids']
    .size()[1]) != 1" and its TORCH_LOGS advice. The line says which size, where, and the range that exports."""
    seq = torch.export.Dim("seq", min=2, max=16)
    with pytest.raises(TpuExportError, match=r"^torch.export: the model's code cannot take seq = 2, at .*test_architectures.py:\d+ "
                                             r"\(if x.shape\[1\] - 1 == 1:\).*; declare seq that range \(--dim seq=3:16, or "
                                             r"torch.export.Dim\('seq', min=3, max=16\)\)"):
        tpuexport.convert(ShiftsByOne(), (torch.randn(2, 8),), {"x": {1: seq}}, out=tmp_path / "m.tpu")
    assert list(tmp_path.iterdir()) == []


def test_the_lines_a_refusal_names_are_read_from_torchs_guard_log_of_that_export_which_stays_quiet(capfd):
    """The refusal's lines came from tracing the model again with torch.export.draft_export, only on
    this path: 403 s on Grounding DINO, past the sweep's 900 s limit on MM Grounding DINO. They are read
    from the guards torch logs at INFO during tpuexport's own export: none of that log reaches stderr,
    and the logger is left as it was."""
    from tpuexport.export import guard_sites

    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    before = (logger.level, list(logger.filters), logger.getEffectiveLevel())
    lines: list[str] = []
    seq = torch.export.Dim("seq", min=2, max=16)
    with pytest.raises(Exception, match="Constraints violated"), guard_sites.recorded(lines):
        torch.export.export(ShiftsByOne(), (torch.randn(2, 8),), dynamic_shapes={"x": {1: seq}})
    assert [re.sub(r"^.*test_architectures.py:\d+ ", "", line) for line in lines] == [
        "(if x.shape[1] - 1 == 1:)", "(return x + torch.nn.functional.pad(x[:, 1:], [0, 1]))"]
    assert (logger.level, list(logger.filters), logger.getEffectiveLevel()) == before
    assert "guard added" not in capfd.readouterr().err


class ReshapesIntoBlocks(torch.nn.Module):
    """Reshapes its length into blocks of 4 on three lines, as PEGASUS-X's blocked local attention
    does on eighteen."""

    def forward(self, x):
        batch, seq = x.shape
        blocks = x.view(batch, seq // 4, 4)
        flat = (blocks * 2).view(batch, seq)
        return (flat + 1).view(batch, seq // 4, 4).sum(-1)


def test_a_refusal_guarded_at_many_lines_names_the_first_and_counts_the_rest(tmp_path):
    """PEGASUS-X's refusal named all 17 lines torch.export guarded its padded length at, 4000
    characters in one line (session 18's sweep). The line names the first and how many more,
    and keeps the declarations that export: the derived dim, or one size of it (--dim declares
    ranges, not multiples), which converts."""
    seq = torch.export.Dim("seq", min=2, max=32)
    with pytest.raises(TpuExportError) as refused:
        tpuexport.convert(ReshapesIntoBlocks(), (torch.randn(2, 8),), {"x": {1: seq}}, out=tmp_path / "m.tpu")
    assert re.fullmatch(r"torch.export: the model's code needs seq = 4\*_seq with _seq in 1..8, at \S*test_architectures.py:\d+ "
                        r"\(blocks = x.view\(batch, seq // 4, 4\)\) and 2 more lines; declare seq as that derived "
                        r"torch.export.Dim in dynamic_shapes, or one size it takes \(--dim seq=32:32, the largest\), or change "
                        r"that code to work for every declared size", str(refused.value))
    assert list(tmp_path.iterdir()) == []
    tpuexport.convert(ReshapesIntoBlocks(), (torch.randn(2, 32),), {"x": {1: 32}}, out=tmp_path / "m.tpu", target="cpu")


class GaussianTopK(torch.nn.Module):
    """Keeps the activations above mean + std x the standard normal's 0.95 quantile, as Gemma 3n's
    MLP does: `Normal(0, 1)` checks its parameters when built, which torch.export records as
    runtime assertions on constants."""

    def __init__(self, sparsity: float = 0.95):
        super().__init__()
        self.sparsity = sparsity

    def forward(self, x):
        quantile = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(self.sparsity, device=x.device))
        return torch.relu(x - (x.mean(-1, keepdim=True) + x.std(-1, keepdim=True, unbiased=False) * quantile))


def test_assertions_on_constants_are_checked_at_conversion_and_dropped(tmp_path):
    """gemma3n_text was refused: "2 operator(s) have no TPU lowering: aten._is_all_true.default ...;
    aten._assert_async.msg" (the sweep, session 19). An assertion on values fixed at export holds
    for every input or for none: it is evaluated once, and the program converts and verifies."""
    x = torch.randn(3, 16)
    artifact = tpuexport.convert(GaussianTopK().eval(), (x,), {"x": {0: torch.export.Dim("batch", min=1, max=8)}},
                                 saved_model=False, out=tmp_path / "model.tpu")
    assert artifact.manifest["verification"]["passed"]
    torch.testing.assert_close(artifact.run(x), GaussianTopK()(x), rtol=1e-5, atol=1e-5)


class ChecksItsFeatureMapSizes(torch.nn.Module):
    """Checks, with transformers' torch_compilable_check, that sizes it makes from numbers on its
    weights' device add up to its sequence, as D-FINE's, RT-DETRv2's and DEIMv2's decoders check
    their feature maps' against the encoder's."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        from transformers.utils.import_utils import torch_compilable_check

        sizes = torch.as_tensor([[2, 3], [1, 2]], device=self.linear.weight.device)
        torch_compilable_check((sizes[:, 0] * sizes[:, 1]).sum() == x.shape[1], "the sizes do not add up")
        return self.linear(x)


def test_a_check_on_sizes_made_from_numbers_is_evaluated_when_weights_stream(tmp_path):
    """D-FINE, RT-DETRv2 and DEIMv2 were refused: "aten._is_all_true.default has no TPU lowering" (the
    check's truth, read as a number, `_local_scalar_dense`, feeds symbolic ops rather than an assertion;
    on the meta device, its sizes were meta tensors). The number is evaluated once, and it converts."""
    torch.manual_seed(0)
    safetensors.torch.save_file(ChecksItsFeatureMapSizes().state_dict(), str(tmp_path / "weights.safetensors"))
    with tpuexport.parameters_on_meta():
        on_meta = ChecksItsFeatureMapSizes().eval()
    x = torch.randn(2, 8, 4)
    artifact = tpuexport.convert(on_meta, (x,), {"x": {0: torch.export.Dim("batch", min=1, max=4)}}, checkpoint=tmp_path / "weights.safetensors",
                                 saved_model=False, out=tmp_path / "model.tpu")
    assert artifact.manifest["verification"]["passed"]


class ResizesAntialiased(torch.nn.Module):
    """Resizes a learned 8 x 8 grid to the image's 6 x 6 and 12 x 12 with antialiasing, as TIPSv2
    (bilinear) and DINOv2 with registers (bicubic) interpolate their position embeddings."""

    def __init__(self):
        super().__init__()
        self.grid = torch.nn.Parameter(torch.randn(1, 4, 8, 8))

    def forward(self, x):
        smaller = torch.nn.functional.interpolate(self.grid, size=(6, 6), mode="bilinear", align_corners=False, antialias=True)
        larger = torch.nn.functional.interpolate(self.grid, size=(12, 12), mode="bicubic", align_corners=False, antialias=True)
        return x + smaller.sum() * larger


def test_antialiased_interpolation_converts(tmp_path):
    """tipsv2_dpt was refused: "lowering failed at aten._upsample_bilinear2d_aa.default ...: TypeError:
    'tuple' object is not callable" (torchax's copy of JAX's resampling; the sweep, session 19)."""
    torch.manual_seed(0)
    model = ResizesAntialiased().eval()
    x = torch.randn(2, 4, 12, 12)
    artifact = tpuexport.convert(model, (x,), {"x": {0: torch.export.Dim("batch", min=1, max=8)}}, saved_model=False, out=tmp_path / "model.tpu")
    assert artifact.manifest["verification"]["passed"]
    with torch.no_grad():
        torch.testing.assert_close(artifact.run(x), model(x), rtol=1e-4, atol=1e-4)


def test_a_causal_lm_listed_under_its_multimodal_type_infers_its_task(tmp_path):
    """transformers lists Emu3ForCausalLM under "emu3" while it takes Emu3TextConfig ("emu3_text_model",
    which no table lists); saved alone, `convert DIR --task auto` was refused with "cannot infer the
    task ...: its config names architectures ['Emu3ForCausalLM'], which no task builds; pass --task,
    one of: none" (the sweep, session 19). The table listing its architecture builds it."""
    from tpuexport.export.huggingface import load_huggingface

    config = transformers.Emu3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.Emu3ForCausalLM(config).save_pretrained(tmp_path / "emu3")
    loaded = load_huggingface(str(tmp_path / "emu3"), "auto")
    assert (loaded.huggingface.task, loaded.huggingface.architecture) == ("text-generation", "Emu3ForCausalLM")


def test_an_audio_encoder_taking_time_major_features_gets_them_so(capfd):
    """Parakeet (and the other FastConformer encoders: LASR, Nemotron's ASR encoders) read mel
    features as [batch, frames, mel bins], Whisper as [batch, mel bins, frames]: given the latter,
    ParakeetForCTC was refused with "a and b must have same reduction dim". Which of the two a model
    takes is found by running it on shapes alone (its weights here on the meta device, as a
    directory's are), and the example inputs follow; the layout that fails logs nothing (fake
    tensors log a failing operator's traceback, which made the sweep count a refusal as a crash)."""
    from tpuexport.export.checkpoints import parameters_on_meta
    from tpuexport.export.huggingface import forward_program

    config = transformers.ParakeetCTCConfig(vocab_size=64, encoder_config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_mel_bins": 16,
        "subsampling_conv_channels": 16, "max_position_embeddings": 64})
    with parameters_on_meta():
        model = transformers.ParakeetForCTC(config).eval()
    wrapped, args, _ = forward_program(model)
    batch, frames, mel_bins = args[0].shape
    assert mel_bins == 16 and frames > mel_bins
    assert "Traceback" not in capfd.readouterr().err


def test_an_audio_encoder_taking_waveforms_with_a_channel_axis_gets_one():
    """PE-Audio's encoder convolves waveforms as [batch, channels, samples]: given [batch, samples]
    it was refused with "expected input[1, s6, 16000] to have 1 channels, but got s6 channels"."""
    from tpuexport.export.checkpoints import parameters_on_meta
    from tpuexport.export.huggingface import forward_program

    with parameters_on_meta():
        model = transformers.PeAudioModel(transformers.PeAudioConfig()).eval()
    wrapped, args, _ = forward_program(model)
    assert args[wrapped.input_names.index("input_values")].shape[1:] == (1, 16000)


def test_an_audio_codec_gets_the_channels_its_config_records():
    """EnCodec, Mimi and Pocket TTS's audio tokenizer read waveforms as [batch, audio_channels, samples]
    and check dim 1 against their config's audio_channels. Given [batch, samples] they were refused as
    "the model's own forward fails ...: not enough values to unpack (expected 3, got 2)": the layout
    with a channel axis was tried on shapes alone, which their padding arithmetic on integer buffers
    (`.item()` of a fake tensor) fails. The config says it: channels a fixed size, before any run."""
    from tpuexport.export.checkpoints import parameters_on_meta
    from tpuexport.export.huggingface import forward_program

    for channels in (1, 2):
        config = transformers.EncodecConfig(audio_channels=channels, hidden_size=32, num_filters=8, num_residual_layers=1,
                                            codebook_size=64, codebook_dim=32)
        with parameters_on_meta():
            model = transformers.EncodecModel(config).eval()
        wrapped, args, dynamic_shapes = forward_program(model)
        assert wrapped.input_names == ("input_values",) and tuple(args[0].shape) == (2, channels, 16000)
        assert 1 not in (dynamic_shapes["input_values"] or {})


def test_example_inputs_take_the_sizes_the_config_records_for_them():
    """wav2vec2-BERT's features are 160 wide (80 mel bins stacked 2 frames at a time: its feature
    projection's feature_projection_input_dim), which its config records without num_mel_bins: given
    80 it was refused with "Given normalized_shape=[160], ... but got input of size torch.Size([2, 80, 128])"
    (NeuCodec and XCodec2, whose semantic encoder it is, too). MGP-STR's images are 32 x 128 (image_size
    [height, width]): given 32 x 32, "Input image size (32*32) doesn't match model (32*128)"."""
    from tpuexport.export.checkpoints import parameters_on_meta
    from tpuexport.export.huggingface import forward_program

    config = transformers.Wav2Vec2BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                             feature_projection_input_dim=24, output_hidden_size=32)
    with parameters_on_meta():
        model = transformers.Wav2Vec2BertModel(config).eval()
    _, args, _ = forward_program(model)
    assert args[0].shape[0] == 2 and args[0].shape[2] == 24
    config = transformers.MgpstrConfig(image_size=[16, 32], patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                       mlp_ratio=2.0, max_token_length=8)
    with parameters_on_meta():
        model = transformers.MgpstrForSceneTextRecognition(config).eval()
    _, args, _ = forward_program(model)
    assert tuple(args[0].shape) == (2, 3, 16, 32)


def test_a_forward_requiring_inputs_tpuexport_does_not_make_is_refused_before_it_runs(tmp_path):
    """SegGPT requires its prompts (prompt_pixel_values, prompt_masks), Gemma 4 its pixel_position_ids,
    ...: called without them the forward failed with Python's "missing 2 required positional
    arguments", reported as the model's own forward failing. They are refused from the forward's
    signature, naming them and what converts. (SigLIP 2's spatial_shapes and pixel_attention_mask, once
    refused so, are made now: tests/test_patch_grids.py.)"""
    config = transformers.SegGptConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_dim=64, image_size=[32, 16],
                                       patch_size=8, merge_index=0, intermediate_hidden_state_indices=[1], decoder_hidden_size=16)
    transformers.SegGptModel(config).save_pretrained(tmp_path / "seggpt")
    result = tpuexport_in_process("convert", tmp_path / "seggpt", "-o", tmp_path / "seggpt.tpu", *QUICK)
    assert result.returncode == 2 and error_lines(result.stderr) == [
        "error: SegGptModel (seggpt) requires prompt_pixel_values, prompt_masks in its forward, which tpuexport "
        "does not make from a directory (it makes pixel_values); convert it from a file.py:factory whose module gives them (as "
        "buffers or from its own inputs) and whose example args are the others"], result.stderr[-2000:]
    assert not (tmp_path / "seggpt.tpu").exists()


def test_an_audio_model_whose_input_values_are_a_spectrogram_gets_one():
    """The Audio Spectrogram Transformer's input_values are mel frames, [batch, max_length, mel bins]:
    given a waveform it was refused with "Dimension out of range (expected to be in range of [-3, 2],
    but got 3)"."""
    from tpuexport.export.checkpoints import parameters_on_meta
    from tpuexport.export.huggingface import forward_program

    config = transformers.ASTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    max_length=64, num_mel_bins=32)
    with parameters_on_meta():
        model = transformers.ASTForAudioClassification(config).eval()
    _, args, _ = forward_program(model)
    assert [tuple(arg.shape) for arg in args] == [(2, 64, 32)]


def test_a_speech_encoder_decoder_is_given_the_audio_input_its_encoder_reads():
    """SpeechEncoderDecoderModel's forward takes input_values and input_features, for whichever its
    encoder reads; given both it was refused with its own "You cannot specify both input_values and
    input_features at the same time"."""
    from tpuexport.export.checkpoints import parameters_on_meta
    from tpuexport.export.huggingface import forward_program

    encoder = transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    decoder = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=64,
                                      is_decoder=True, add_cross_attention=True)
    config = transformers.SpeechEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    with parameters_on_meta():
        model = transformers.SpeechEncoderDecoderModel(config).eval()
    wrapped, _, _ = forward_program(model)
    assert wrapped.input_names == ("decoder_input_ids", "input_values")


def test_a_video_tower_gets_a_clip_of_the_frames_its_config_records(tmp_path):
    """VideoMAE, ViViT, TimeSformer, V-JEPA 2 and VideoPrism read pixel_values as [batch, frames,
    channels, height, width]: given a batch of images they were refused with "not enough values to
    unpack (expected 5, got 4)". They get clips of the config's num_frames (V-JEPA 2: frames_per_clip,
    its crop_size as the image size) and convert."""
    config = transformers.VideoMAEConfig(image_size=32, patch_size=8, num_frames=4, tubelet_size=2, hidden_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, intermediate_size=64)
    transformers.VideoMAEModel(config).save_pretrained(tmp_path / "videomae")
    result = tpuexport_in_process("convert", tmp_path / "videomae", "-o", tmp_path / "videomae.tpu", *QUICK)
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = json.loads((tmp_path / "videomae.tpu" / "manifest.json").read_text())
    assert manifest["verification"]["passed"]
    assert [spec["shape"] for spec in manifest["entry_points"]["serving_default"]["signature"]["inputs"]] == [["batch", 4, 3, 32, 32]]


def test_a_time_series_model_gets_the_context_and_channels_its_config_records(tmp_path):
    """PatchTST and PatchTSMixer read past_values [batch, context_length, num_input_channels]: refused
    before as taking none of the known inputs. They convert at the config's context and channels, and
    the artifact runs as eager does."""
    config = transformers.PatchTSTConfig(num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=16,
                                         num_attention_heads=2, num_hidden_layers=1, ffn_dim=32)
    torch.manual_seed(0)
    model = transformers.PatchTSTModel(config).eval()
    model.save_pretrained(tmp_path / "patchtst")
    result = tpuexport_in_process("convert", tmp_path / "patchtst", "-o", tmp_path / "patchtst.tpu", *QUICK)
    assert result.returncode == 0, result.stderr[-2000:]
    artifact = tpuexport.load(tmp_path / "patchtst.tpu")
    assert artifact.manifest["huggingface"]["task"] == "feature-extraction"
    assert [spec["shape"] for spec in artifact.manifest["entry_points"]["serving_default"]["signature"]["inputs"]] == [["batch", 32, 3]]
    series = torch.randn(3, 32, 3)
    with torch.no_grad():
        expected = model(past_values=series).last_hidden_state
    np.testing.assert_allclose(artifact.run(series)["last_hidden_state"].numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type, check", [
    # DeepSeek-V2's defaults leave num_experts_per_tok None: topk() "argument 'k' must be int, not NoneType".
    ("deepseek_v2", lambda model: model.config.num_experts_per_tok == 2),
    # Its neck's tapped layers must stay a list of layers the cut model has (None is no list: not built).
    ("data2vec-vision", lambda model: model.config.out_indices == [0, 0, 1, 1]),
    # Its full-attention layers' head_dim 512 sits in per_layer_config, which kept it: with attention scaled by 1 over
    # q/k-normed heads, logits of std ~sqrt(512) turned one bf16 pass into a relative RMS error of 0.08 (verification failed).
    ("embedding_gemma2_text", lambda model: {layer.self_attn.head_dim for layer in model.layers} == {16}),
    # 15 of its 35 layers reuse another's KV cache; kept at 15 of 2, the config refused the layer types left producing one.
    ("gemma3n_text", lambda model: model.config.num_kv_shared_layers == 0),
    # Ministral's and HunYuan's defaults leave head_dim None, which their attention takes as is: None ** -0.5 (not built).
    ("ministral", lambda model: model.config.head_dim == model.config.hidden_size // model.config.num_attention_heads),
    # DPT-style necks take one feature map per tapped layer (4): with 2 layers tapped once, "The number of hidden states
    # should be equal to the number of neck hidden sizes" (DPT's own backbone_out_indices; Depth Anything's backbone's).
    ("dpt", lambda model: model.config.backbone_out_indices == [0, 1, 2, 3] and model.config.num_hidden_layers == 4),
    ("depth_anything", lambda model: model.config.backbone_config.out_indices == [1, 2, 3, 4]),
    # The causal LM table lists Qwen3_5MoeForCausalLM under the multimodal type, whose config has no vocab_size: built from its text config.
    ("qwen3_5_moe", lambda model: model.config.model_type == "qwen3_5_moe_text"),
    # EfficientNet's (and ALIGN's vision tower's) defaults are B7's compound scaling, 2.0 wide and 3.1 deep: 47M parameters
    # at every level (not built). The base network's 1.0 and 1.0.
    ("efficientnet", lambda model: (model.config.width_coefficient, model.config.depth_coefficient) == (1.0, 1.0)),
    # Perceiver's latents are d_latents wide through num_self_attends_per_block layers (1280 and 26): 260M parameters at every level.
    ("perceiver", lambda model: (model.config.d_latents, model.config.num_self_attends_per_block) == (64, 2)),
    # Sapiens2's per-layer key/value heads (16 and 8 of 16 heads) stayed above the 4 heads left: its attention's shapes did not
    # match at any level but the last (34M parameters). Its segmentation head's channels have no default (not built): overrides.
    ("sapiens2", lambda model: model.config.num_key_value_heads_per_layer == [4, 2]),
], ids=lambda value: value if isinstance(value, str) else "")
def test_the_sweeps_shrink_builds_configs_whose_defaults_do_not_shrink_as_they_are(model_type, check):
    """benchmarks/architectures.py: an MoE config whose defaults leave its counts unset gets them;
    lists and counts of layers are cut with the layers; per-layer settings shrink as the model's
    own. Each type builds tiny at the first level and runs one eager forward."""
    import architectures

    model, record = architectures.tiny_model(model_type)
    assert record["eager"] == "ok" and record["level"] == "everything"
    assert check(model)


@pytest.mark.parametrize("model_type, check", [
    # ESM's defaults record no vocabulary and no padding id, which its embeddings and positions read (None: not built).
    ("esm", lambda model: (model.config.vocab_size, model.config.pad_token_id) == (512, 1)),
    # DiffusionGemma always builds its MoE block, whose counts its defaults leave None (not built).
    ("diffusion_gemma", lambda model: (model.config.text_config.num_experts, model.config.text_config.top_k_experts) == (4, 2)),
    # Nemotron's leave its key/value heads None, which its attention divides by: as many as the query heads, as Llama reads None.
    ("nemotron", lambda model: model.config.num_key_value_heads == model.config.num_attention_heads == 4),
], ids=lambda value: value if isinstance(value, str) else "")
def test_the_sweeps_last_level_gives_sizes_a_config_leaves_unset(model_type, check):
    """benchmarks/architectures.py: when no other level builds, the last gives the sizes (and
    padding id) a config leaves None; earlier levels keep None, which elsewhere means none."""
    import architectures

    model_class = getattr(transformers, architectures.model_types()[model_type][1])
    with pytest.raises(TypeError, match="NoneType"):
        model_class(architectures.tiny_config(model_type, 0))
    model, record = architectures.tiny_model(model_type)
    assert record["eager"] == "ok" and record["level"] == "everything, unset sizes given"
    assert check(model)


def test_the_sweeps_shrink_keeps_mimis_upsampling_groups_its_channels():
    """Mimi's depthwise upsampling has as many groups as the hidden size has channels (512): with the
    hidden size shrunk and the groups not, "in_channels must be divisible by groups" at every level
    that builds under the parameter cap (Mimi, and CSM's and Kyutai's codecs: not built)."""
    import architectures

    config = architectures.tiny_config("mimi", 0)
    assert config.upsample_groups == config.hidden_size == 64


def test_the_sweeps_shrink_keeps_a_layer_count_that_counts_stages():
    """MuseSpark's audio encoder counts its 4 stages in num_hidden_layers, beside per-stage depths and
    widths: cut to 2 layers, its config refused the 4 stages left (not built at any level)."""
    import architectures

    config = architectures.tiny_config("muse_spark_audio", 0)
    assert config.num_hidden_layers == len(config.depths) == len(config.hidden_sizes) == 4
    assert max(config.depths) <= 2


def test_a_video_model_taking_pixel_values_videos_gets_clips():
    """V-JEPA 2 and VideoPrism name their clips pixel_values_videos: they were refused as taking
    "none of input_ids, pixel_values, input_values, input_features". They get clips of the config's
    frames (V-JEPA 2: frames_per_clip) at its crop_size, which the forward runs on."""
    from tpuexport.export.huggingface import forward_program

    config = transformers.VJEPA2Config(crop_size=32, patch_size=8, frames_per_clip=4, tubelet_size=2, hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=4, pred_hidden_size=32, pred_num_hidden_layers=1, pred_num_attention_heads=4)
    wrapped, args, dynamic_shapes = forward_program(transformers.VJEPA2Model(config).eval())
    assert wrapped.input_names == ("pixel_values_videos",) and args[0].shape == (2, 4, 3, 32, 32)
    with torch.no_grad():
        assert wrapped(*args)["last_hidden_state"].shape == (2, 2 * 4 * 4, 32)


def test_a_guard_python_cannot_evaluate_still_gives_the_one_line_explanation():
    """PEGASUS-X pads its input to whole blocks: torch.export's guard text calls `.sym_max(...)` on a
    size, which evaluating it at plain ints fails on with an AttributeError, and its conversion
    crashed with that traceback (the sweep, session 18; `convert DIR --task auto` of a tiny
    PEGASUS-X now ends in one line, "the model's code needs seq = 8*_seq with _seq in 1..8, at ...").
    Such a guard gives no sizes, and the others in the message are still read."""
    from tpuexport.export.constraints import guarded_sizes

    message = ("Not all values of seq = L['x'].size()[1] in the specified range seq <= 64 satisfy the generated guard "
               "(L['x'].size()[1]).sym_max(8) != 1\n"
               "Not all values of batch = L['y'].size()[0] in the specified range batch <= 64 satisfy the generated guard "
               "((-1) + L['y'].size()[0]) != 1")
    assert guarded_sizes(message, {"seq": (2, 64), "batch": (2, 64)}) == {"batch": (list(range(3, 65)), [])}


class PadsPastAWindow(torch.nn.Module):
    """Pads only past a window of 5, as VITS's relative position embeddings do: torch.export's guard
    `torch.sym_max(0, (-5) + seq) > 0` comes with no suggested fix."""

    def forward(self, x):
        pad = max(x.shape[1] - 5, 0)
        if pad > 0:
            x = torch.nn.functional.pad(x, [pad, pad])
        return x * 2


def test_a_lower_bound_from_a_max_guard_names_the_range_that_exports(tmp_path):
    """VITS was refused with torch's raw "Constraints violated (seq)! ... satisfy the generated guard
    torch.sym_max(0, (-5) + L['input_ids'].size()[1]) > 0" (session 22's sweep). The guards are evaluated
    at each declared size: the line names the range where they hold and how to declare it."""
    seq = torch.export.Dim("seq", min=2, max=64)
    with pytest.raises(TpuExportError, match=r"^torch.export: the model's code needs seq in 6..64, at .*test_architectures.py:\d+ "
                                             r"\(if pad > 0:\); declare seq that range \(--dim seq=6:64, or "
                                             r"torch.export.Dim\('seq', min=6, max=64\)\)"):
        tpuexport.convert(PadsPastAWindow(), (torch.randn(2, 8),), {"x": {1: seq}}, out=tmp_path / "m.tpu")


class RelativeToAbsolute(torch.nn.Module):
    """VITS's relative-to-absolute positions: seq * (2 seq - 1) scores padded and viewed as seq + 1 rows,
    which torch.export guards with `(2 seq^2 + seq - 1) % (seq + 1) == 0`, true at every seq, and cannot prove."""

    def forward(self, x):
        batch, length = x.shape
        relative = torch.nn.functional.pad(x[:, :, None] * x.new_ones(1, 1, 2 * length - 1), [0, 1])
        flat = torch.nn.functional.pad(relative.reshape(batch, 2 * length * length), [0, length - 1])
        return flat.view(batch, length + 1, 2 * length - 1)[:, :length, length - 1:]


def test_a_guard_that_holds_at_every_size_but_torch_cannot_prove_asks_for_a_static_size(tmp_path):
    """With VITS's range declared (--dim seq=6:512) torch.export still raised its raw message for a guard
    that holds at every size: no range exports, the size it traced at does."""
    seq = torch.export.Dim("seq", min=2, max=64)
    with pytest.raises(TpuExportError, match=r"^torch.export: the model's code has a guard \(\(\(-1\) \+ seq \+ 2\*seq\*seq\) % "
                                             r"\(1 \+ seq\)\) == 0 that holds at every declared seq but torch.export cannot prove "
                                             r"for a range, at .*test_architectures.py:\d+ .*; declare seq static \(--dim seq=8:8"):
        tpuexport.convert(RelativeToAbsolute(), (torch.randn(2, 8),), {"x": {1: seq}}, out=tmp_path / "m.tpu")


class DrawsNoiseWithAGenerator(torch.nn.Module):
    """Draws noise of its input's shape through randn's generator overload, as UnivNet does."""

    def forward(self, x):
        return x + torch.randn(x.shape, generator=None)


def test_an_op_that_takes_only_fixed_sizes_names_the_line_and_the_dims(tmp_path):
    """UnivNet was refused with torch's raw "SymIntArrayRef expected to contain only concrete integers
    ... Found symbolic SymInt at index 0: s6" (session 22's sweep): the line names the op, the dims its
    size comes from, the model's line, and the static sizes that export."""
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=64)
    with pytest.raises(TpuExportError, match=r"^torch.export: the model's code passes a size from batch and seq to "
                                             r"aten.randn.generator, which takes only fixed sizes, at .*test_architectures.py:\d+ "
                                             r"\(return x \+ torch.randn\(x.shape, generator=None\)\); declare batch static "
                                             r"\(--dim batch=2:2, .*\) and seq static \(--dim seq=8:8"):
        tpuexport.convert(DrawsNoiseWithAGenerator(), (torch.randn(2, 8),), {"x": {0: batch, 1: seq}}, out=tmp_path / "m.tpu")


class VanishingThenNormalized(torch.nn.Module):
    """Activations of about 1e-30 divided by their L2 norm, as ALIGN's random tiny image tower gives
    its embeddings (each block scales them by ~1e-4 down to 1e-24): the squares underflow in f32, the
    norm is 0 and eager PyTorch's output is +-inf everywhere. Pairs of weight rows differ below
    bfloat16's resolution, so the TPU's one-pass products cancel where f32's do not (NaN for +-inf)."""

    def __init__(self):
        super().__init__()
        rows = torch.randn(4, 8).to(torch.bfloat16).float()  # exact in bfloat16: the + 1e-4 share rounds away
        self.linear = torch.nn.Linear(8, 8, bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(torch.stack([rows, rows * (1 + 1e-4)], dim=1).reshape(8, 8))

    def forward(self, x):
        y = self.linear(x)
        vanished = (y[:, 1::2] - y[:, 0::2]) * 1e-25
        return vanished / vanished.norm(dim=-1, keepdim=True)


def test_a_departure_only_where_eager_pytorch_is_not_finite_says_so(tmp_path):
    """ALIGN's tiny model failed verification in the TPU run only, with the hint to raise the matmul
    precision; but its reference itself was inf (a norm underflowing to 0), and the TPU run departed
    where an infinity's sign flipped. The failure now says eager PyTorch's own output is inf or NaN
    there, and blames no matmul precision."""
    torch.manual_seed(0)
    model = VanishingThenNormalized().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert not torch.isfinite(model(x)).any()
    with pytest.raises(tpuexport.VerificationError) as failure:
        tpuexport.convert(model, (x,), saved_model=False, out=tmp_path / "model.tpu")
    message = str(failure.value)
    assert "(tpu run)" in message and "(cpu run)" not in message, message
    assert "eager PyTorch's own 'output_0' is inf or NaN at 8 of the elements the runs depart at (static shapes)" in message, message
    assert "--matmul-precision" not in message and "max abs error inf" in message, message
    # ALIGN's departures were infinities of flipped sign: an infinite error (numpy's nan_to_num made it 1.8e+308), equal ones none.
    from tpuexport.verify.compare import Tolerances, compare_output

    flipped = compare_output("embeds", np.array([-np.inf, np.inf, 1.0]), np.array([np.inf, np.inf, 1.0]), Tolerances(atol=1e-5, rtol=1e-5))
    assert (flipped.max_abs_error, flipped.mismatched, flipped.reference_not_finite) == (np.inf, 1, 1)


def test_a_decoder_whose_layers_keep_no_kv_cache_names_the_full_sequence_workaround(tmp_path):
    """MiniMax's linear-attention layers keep no KV cache: refused for text generation in one line that
    names the workaround, its full-sequence forward (which converts: the test below)."""
    config = transformers.MiniMaxConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
                                        max_position_embeddings=32, layer_types=["linear_attention", "full_attention"])
    with pytest.raises(TpuExportError, match=r"MiniMaxForCausalLM has linear_attention layers, .* do not support yet .*; "
                                             r"its full-sequence forward may convert \(--task feature-extraction\)$"):
        tpuexport.convert(transformers.MiniMaxForCausalLM(config).eval(), task="text-generation", out=tmp_path / "lm.tpu")


class BlockLoop(torch.nn.Module):
    """Walks the sequence in blocks as MiniMax's lightning attention does, each ending at
    `min(start + block, seq_len)` (torch.sym_min of a symbolic size; FLOPs in `Min(256, seq)`)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        end = min(0 + 256, x.shape[1])
        return self.linear(x[:, :end]).softmax(-1)


def test_sizes_made_with_min_of_a_symbolic_size_convert(tmp_path):
    """MiniMax's full-sequence forward (--task feature-extraction) was refused: "lowering failed at
    sym_min ... got <class '_DimExpr'>", and once lowered, the FLOPs expression `Min(256, seq)` did
    not parse ("'Symbol' object is not callable"). A min or max of sizes is a size (JAX's min_dim)."""
    torch.manual_seed(0)
    model, x = BlockLoop().eval(), torch.randn(2, 12, 8)
    artifact = tpuexport.convert(model, (x,), {"x": {1: torch.export.Dim("seq", min=2, max=32)}}, saved_model=False,
                                 verify_budget_flops=0, out=tmp_path / "model.tpu")
    assert artifact.manifest["verification"]["passed"]
    torch.testing.assert_close(artifact.run(x[:, :5]), model(x[:, :5]), rtol=1e-2, atol=1e-3)


def test_the_sweeps_eager_check_flags_a_tiny_model_whose_outputs_are_not_finite():
    """ALIGN's random tiny image tower scales its activations by ~1e-4 a block, to 1e-24; the L2 norm
    of its embeddings underflows to 0 and every embedding is +-inf in eager PyTorch, at every shrink
    level. The sweep's row says the tiny model's eager forward is not usable (its `eager` column), so
    that its verification failure is not read as the conversion's."""
    import architectures

    _, record = architectures.tiny_model("align")
    assert record["eager"] == ("FloatingPointError: eager outputs ['logits_per_image'], ['logits_per_text'], ['image_embeds'] hold "
                               "inf or NaN at the tiny config")


class ThresholdMask(torch.nn.Module):
    """An additive mask from predicted logits thresholded, as Mask2Former's masked attention makes
    with `sigmoid(mask_logits) < 0.5`. The logits are differences of weight rows equal in bfloat16:
    +-1e-4 in f32, exactly 0 in one bf16 pass, so every pixel's side of the threshold is a near-tie."""

    def __init__(self):
        super().__init__()
        rows = torch.randn(4, 8).to(torch.bfloat16).float()
        self.mask_logits = torch.nn.Linear(8, 8, bias=False)
        with torch.no_grad():
            self.mask_logits.weight.copy_(torch.stack([rows, rows * (1 + 1e-4)], dim=1).reshape(8, 8))
        self.values = torch.nn.Linear(8, 4)

    def forward(self, x):
        logits = self.mask_logits(x)
        masked = (logits[:, 1::2] - logits[:, 0::2]).sigmoid() < 0.5
        return torch.where(masked, -1.0, 0.0) + self.values(x)


def test_matmuls_feeding_a_threshold_mask_are_pinned_as_decisions(tmp_path):
    """Mask2Former failed verification in the TPU run only (17 of 12,800 decoder outputs, max abs
    error 0.7): one bf16 pass moved mask logits across 0.5 and a query attended to other pixels. A
    comparison whose boolean selects between values not computed from what it compares is a decision
    like a top-k: the matmuls computing its inputs are pinned to highest. An activation's comparison
    (softplus: `where(x > 20, x, log1p(exp(x)))`) is continuous and pins nothing."""
    torch.manual_seed(0)
    model, x = ThresholdMask().eval(), torch.randn(16, 8)
    artifact = tpuexport.convert(model, (x,), saved_model=False, out=tmp_path / "model.tpu")
    assert artifact.manifest["verification"]["passed"]
    assert artifact.manifest["entry_points"]["serving_default"]["decision_matmuls"] == [
        {"op": "mm", "module": "mask_logits", "feeds": "aten.lt.Scalar", "precision": "highest"}]

    from tpuexport.lower.matmul_precision import decision_matmuls

    softplus = torch.export.export(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softplus()), (x,)).run_decompositions()
    assert decision_matmuls(softplus.graph) == {}


class ConfiguredShiftsByOne(ShiftsByOne):
    """ShiftsByOne with a Hugging Face-style config, as the line names a model by its config's model_type."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(model_type="shifter")


def test_a_size_a_hugging_face_models_code_rules_out_names_the_architecture(tmp_path):
    """The lines explaining a size torch.export's guards rule out named the file, not the model
    (PP-DocLayout-V3, D-FINE, DEIMv2: "torch.export: the model's code fixes batch at 2, at ..."), unlike
    every other refusal of torch.export's (MobileBERT's embeddings, which cannot take seq = 2, as this module)."""
    seq = torch.export.Dim("seq", min=2, max=16)
    with pytest.raises(TpuExportError, match=r"^torch.export on ConfiguredShiftsByOne \(shifter\): the model's code cannot take seq = 2, "
                                             r"at .*test_architectures.py:\d+ .*declare seq that range \(--dim seq=3:16"):
        tpuexport.convert(ConfiguredShiftsByOne(), (torch.randn(2, 8),), {"x": {1: seq}}, out=tmp_path / "m.tpu")


def test_a_directory_whose_code_fixes_the_batch_converts_one_row_a_call(tmp_path):
    """Pixtral's vision tower lists each image's size per row (`[(height, width)] * batch_size`), fixing
    the batch torch.export traced at (2); RT-DETR, D-FINE and ZoeDepth do the same. A directory's
    model, whose batch range tpuexport chose, converts with batch 1 (one image a call), the export line
    naming the code; a dim other than batch fixed to one size, or a batch the user gave, stays refused."""
    config = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                              head_dim=8, image_size=32, patch_size=16)
    torch.manual_seed(0)
    transformers.PixtralVisionModel(config).eval().save_pretrained(tmp_path / "pixtral")
    result = tpuexport_in_process("convert", tmp_path / "pixtral", "-o", tmp_path / "pixtral.tpu", *QUICK)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"dims batch 1\.\.1: the model's code fixes batch at 2, at \S*modeling_pixtral.py:\d+ \(image_sizes = ", result.stderr)
    artifact = tpuexport.load(tmp_path / "pixtral.tpu")
    assert artifact.signature.inputs[0].shape[0] == 1 and artifact.manifest["verification"]["passed"]
    given = tpuexport_in_process("convert", tmp_path / "pixtral", "-o", tmp_path / "given.tpu", *QUICK, "--dim", "batch=1:4")
    assert given.returncode == 2 and "the model's code fixes batch at 2" in error_lines(given.stderr)[0], given.stderr[-2000:]


def test_inputs_a_model_cannot_take_are_refused_as_such_whatever_sizes_the_messages_name(tmp_path):
    """Gemma 4's audio encoder takes more mel bins than the 80 tpuexport gives where its config records
    none: torch.export's error names a symbolic size (of the batch), the eager run's its value ("[40, 6000]
    X ..."), and the line is the model's own forward failing, not torch.export's failure with "check the
    example args". (SigLIP 2's classifier, which failed so on images, takes its flattened patches now.)"""
    from tpuexport.export import capture, load_source

    config = transformers.Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, subsampling_conv_channels=[16, 8],
                                            output_proj_dims=32)
    transformers.Gemma4AudioModel(config).save_pretrained(tmp_path / "gemma4_audio")
    with pytest.raises(TpuExportError, match=r"^the model's own forward fails on Gemma4AudioModel \(gemma4_audio, given "
                                             r"input_features\) at the example sizes \(\[2, 80, 3000\]\), run without torch.export: a "
                                             r"and b must have same reduction dim, but got \[40, 6000\] X \[32, 32\]\.; these inputs do "
                                             r"not suit it"):
        capture(load_source(str(tmp_path / "gemma4_audio")))


class MasksAtRandom(torch.nn.Module):
    """Drops a random half of its patches, as ViTMAE's random masking does with torch.rand noise;
    and has a dropout layer, which in eval mode draws nothing."""

    def __init__(self):
        super().__init__()
        self.linear, self.dropout = torch.nn.Linear(8, 8), torch.nn.Dropout(0.1)

    def forward(self, x):
        noise = torch.rand(x.shape[:2], device=x.device)
        return self.dropout(self.linear(x)) * (noise > 0.5).unsqueeze(-1)


def test_a_forward_that_draws_random_numbers_is_refused_in_one_line(tmp_path):
    """ViTMAE was refused as "lowering failed at aten.rand.default ... AttributeError: 'NoneType'
    object has no attribute 'get_and_rotate_prng_key'; this op or shape pattern is not supported yet"."""
    with pytest.raises(TpuExportError, match=r"^torch.export: its forward draws random numbers \(aten.rand.default\) at "
                                             r"\S*test_architectures.py:\d+ \(noise = torch.rand\(x.shape\[:2\], .*\)\), so no two runs "
                                             r"agree .*as ViTMAE's takes noise=\)$"):
        tpuexport.convert(MasksAtRandom().eval(), (torch.randn(2, 4, 8),), out=tmp_path / "m.tpu")
    assert list(tmp_path.iterdir()) == []
    # Dropout in eval mode and attention without dropout (torch tags both ops nondeterministic_seeded) draw nothing.
    attention = transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                               intermediate_size=32, attn_implementation="sdpa")).eval()
    artifact = tpuexport.convert(attention, (torch.randint(0, 64, (2, 8)),), saved_model=False, verify_budget_flops=0,
                                 out=tmp_path / "attention.tpu")
    assert artifact.manifest["verification"]["passed"]


class FixesBatchBehindACheck(torch.nn.Module):
    """Checks a tensor it makes on its weights' device with transformers' torch_compilable_check, then
    takes len() of its input (fixing the batch), as D-FINE's and RT-DETR's decoders do."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        from transformers.utils.import_utils import torch_compilable_check

        torch_compilable_check(torch.tensor(True, device=self.linear.weight.device), "never raised")
        rows = len(x)
        return self.linear(x).reshape(rows, -1)


def test_a_forward_reading_a_constant_on_its_weights_device_is_explained_when_weights_stream(tmp_path):
    """Exported on the meta device (weights streamed from a checkpoint), such a forward was refused
    with "torch.export failed: Cannot cast tensor(False) to number" (or, as D-FINE and DEIMv2, its
    fixed batch with no line of the model's code): it is exported again with the checkpoint's tensors,
    and refused as with its weights in memory."""
    torch.manual_seed(0)
    safetensors.torch.save_file(FixesBatchBehindACheck().state_dict(), str(tmp_path / "weights.safetensors"))
    with tpuexport.parameters_on_meta():
        on_meta = FixesBatchBehindACheck().eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    with pytest.raises(TpuExportError, match=r"^torch.export: the model's code fixes batch at 2, at \S*test_architectures.py:\d+ "
                                             r"\(rows = len\(x\)\); declare batch static \(--dim batch=2:2"):
        tpuexport.convert(on_meta, (torch.randn(2, 4),), {"x": {0: batch}}, checkpoint=tmp_path / "weights.safetensors",
                          out=tmp_path / "model.tpu")


class FramesOfFour(torch.nn.Module):
    """An audio encoder taking waveforms of whole frames, checked as transformers checks them
    (`torch_compilable_check`: a bare `torch._check` under torch.export, a ValueError with its message
    eagerly), as MuseSpark's audio encoder takes multiples of 1920 samples."""

    def forward(self, input_values):
        from transformers.utils.import_utils import torch_compilable_check

        torch_compilable_check(input_values.shape[1] % 4 == 0, f"length {input_values.shape[1]} is not a multiple of 4")
        return input_values.view(input_values.shape[0], -1, 4).sum(-1)


def test_a_check_that_fails_bare_under_torch_export_is_refused_with_the_models_message(tmp_path):
    """torch.export's error was "Expected cond to be True, but got False" with "check the example args";
    the line says what the model's check says, eagerly."""
    with pytest.raises(TpuExportError, match=r"^the model's own forward fails at the example sizes \(\[2, 10\]\), run without "
                                             r"torch.export: ValueError: length 10 is not a multiple of 4; these inputs do not suit it"):
        tpuexport.convert(FramesOfFour(), (torch.randn(2, 10),), {"input_values": {1: torch.export.Dim("frames", max=64)}},
                          out=tmp_path / "m.tpu")


class CastsItsRouter(torch.nn.Module):
    """A router cast to its dtype in forward, as Switch Transformers' (`self.classifier = self.classifier.to(self.dtype)`)."""

    def __init__(self):
        super().__init__()
        self.classifier = torch.nn.Linear(8, 4)

    def forward(self, x):
        self.classifier = self.classifier.to(torch.float32)
        return self.classifier(x)


def test_a_forward_casting_its_own_module_to_the_dtype_it_has_exports():
    """torch.export failed with "_apply(): Couldn't swap Linear.weight" (refused as "check the example
    args"); the unchanged cast is skipped while exporting, and a cast that changes the weights still fails."""
    from tpuexport.export import LoadedSource, SourceInfo, capture

    x, model = torch.randn(2, 8), CastsItsRouter().eval()
    captured = capture(LoadedSource(model, (x,), None, None, SourceInfo("api")))
    torch.testing.assert_close(captured.program.module()(x), model(x))
    assert torch.nn.Module._apply.__name__ == "_apply"  # the process is left as it was
    with pytest.raises(TpuExportError, match="Couldn't swap Linear.weight"):
        capture(LoadedSource(CastsItsRouter().double().eval(), (x.double(),), None, None, SourceInfo("api")))


def test_an_audio_model_counting_its_features_from_its_mask_takes_whole_clips(tmp_path):
    """Audio Flamingo 3 makes as many audio features as its frame mask's valid frames say (a count
    from values: "how many features it makes depends on its inputs' values: aten.nonzero"), and
    checks them against its placeholder tokens with an indexing torch.export sizes by values even
    with the check off. The mask becomes a constant of the program, every frame valid (whole clips,
    as Whisper's), the placeholders are counted over it, and the check's dead arguments are dropped:
    it converts, and its outputs match eager PyTorch given that mask."""
    config = transformers.AudioFlamingo3Config(
        audio_config={"num_mel_bins": 16, "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 4, "encoder_ffn_dim": 64,
                      "max_source_positions": 8},
        text_config={"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 32},
        audio_token_id=63)
    torch.manual_seed(0)
    model = transformers.AudioFlamingo3ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path / "af3")
    result = tpuexport_in_process("convert", tmp_path / "af3", "-o", tmp_path / "af3.tpu", *QUICK, "--target", "cpu")
    assert result.returncode == 0, result.stderr[-2000:]
    artifact = tpuexport.load(tmp_path / "af3.tpu")
    assert [spec.name for spec in artifact.signature.inputs] == ["input_ids", "input_features", "attention_mask"]
    (placeholder,) = next(spec for spec in artifact.signature.inputs if spec.name == "input_ids").placeholders
    features = torch.randn(1, 16, 16)
    with torch.no_grad():
        count = model.get_audio_features(features, torch.ones(1, 16, dtype=torch.long)).pooler_output.shape[0]
    assert placeholder == tpuexport.signature.Placeholder(63, count, "input_features")
    ids = torch.randint(0, 63, (1, count + 3))
    ids[0, 1:1 + count] = 63
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = model(input_ids=ids, input_features=features, input_features_mask=torch.ones(1, 16, dtype=torch.long),
                         attention_mask=mask).logits
    torch.testing.assert_close(artifact.run(ids, features, mask)["logits"], expected, atol=1e-4, rtol=1e-4)


def test_a_multimodal_audio_model_gets_the_layout_and_the_mask_its_features_method_takes():
    """Granite Speech's encoder reads mel features time-major ([batch, frames, 160]): its placeholders
    are counted over the first layout its get_audio_features takes (it was refused as "a and b must have
    same reduction dim"). Its forward's optional input_features_mask selects rows of its projected
    features, not frames (its get_audio_features takes none): not made, as its processor leaves it out
    for whole clips (given a frame mask, eager PyTorch indexed out of bounds)."""
    from tpuexport.export.checkpoints import parameters_on_meta
    from tpuexport.export.huggingface import forward_program

    config = transformers.GraniteSpeechConfig(
        encoder_config={"input_dim": 16, "num_layers": 1, "hidden_dim": 32, "feedforward_mult": 2, "num_heads": 4, "dim_head": 8,
                        "output_dim": 12, "context_size": 20, "max_pos_emb": 64},
        projector_config={"hidden_size": 32, "encoder_hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                          "intermediate_size": 64, "max_position_embeddings": 64},
        text_config={"model_type": "granite", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 2048},
        audio_token_index=63, window_size=5, downsample_rate=5)
    with parameters_on_meta():
        model = transformers.GraniteSpeechForConditionalGeneration(config).eval()
    wrapped, args, _ = forward_program(model)
    assert wrapped.input_names == ("input_ids", "input_features", "attention_mask")
    assert args[1].shape[-1] == 16 and args[1].shape[1] > 16  # [batch, frames, mel features]


def test_the_mel_bins_of_an_audio_tower_nested_deeper_or_stacked_are_found():
    """The frame width of input_features: the Nemotron speech LM records its mel bins two configs
    down (audio_config.asr_config), FunASR stacks 7 frames of 80 bins into one of 560 (its low frame
    rate features): both were given 80 and refused by their own forwards."""
    from tpuexport.export.huggingface import _feature_width

    assert _feature_width(transformers.FunAsrNanoConfig()) == 560
    assert _feature_width(transformers.Nemotron3_5TranscribeConfig()) == 128
    assert _feature_width(transformers.WhisperConfig(num_mel_bins=128)) == 128


def test_an_audio_tokenizer_taking_whole_tokens_gets_a_waveform_of_them():
    """MuseSpark's audio tokenizer takes waveforms of whole tokens (1920 samples each, its config's
    samples_per_token), as its feature extractor pads them: 16000 samples were refused by its own
    forward ("not a multiple of 1920"); the example waveform is rounded up to whole tokens."""
    from tpuexport.export.checkpoints import parameters_on_meta
    from tpuexport.export.huggingface import forward_program

    config = transformers.MuseSparkAudioConfig()
    with parameters_on_meta():
        model = transformers.AutoModel.from_config(config).eval()
    wrapped, args, _ = forward_program(model)
    assert wrapped.input_names == ("input_values",)
    assert args[0].shape[-1] == 17280 == 9 * config.samples_per_token
