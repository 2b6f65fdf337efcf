"""Hugging Face model directories as sources, through the command line: tiny random-weight models
written with save_pretrained into temporary directories (nothing is downloaded), converted with
--task or --task auto, and `hf:ORG/NAME` resolved in a temporary HF_HOME cache."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from tpuexport import TpuExportError, convert, load
from tpuexport.export import load_source, parse_dim
from tpuexport.export.huggingface import longest_positions
from test_cli import tpuexport_in_process  # the command line, in this process (the hf: sources below run the command itself)

transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
REVISION = "0123456789abcdef0123456789abcdef01234567"
# Bounded dims and no optional verification sizes: each conversion takes seconds.
QUICK = ("--target", "v5e", "--no-saved-model", "--verify-budget", "0")


def tpuexport(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    """The command in its own process, with `env` added (a Hugging Face cache of the test's own)."""
    environment = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "tpuexport.cli", *map(str, args)], capture_output=True, text=True, timeout=900,
                          env=environment, cwd=cwd)


def save(model: torch.nn.Module, directory: pathlib.Path) -> pathlib.Path:
    torch.manual_seed(0)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, pathlib.Path]:
    """save_pretrained directories: a BERT classifier with its tokenizer, a Llama LM, a ViT
    classifier and a wav2vec2 audio classifier."""
    root = tmp_path_factory.mktemp("hf-models")
    torch.manual_seed(0)
    bert = save(transformers.BertForSequenceClassification(transformers.BertConfig(**TEXT, num_labels=3)), root / "bert")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *[f"w{i}" for i in range(95)]]) + "\n")
    transformers.BertTokenizer(str(vocab)).save_pretrained(bert)
    llama = save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT, num_key_value_heads=2)), root / "llama")
    vit = save(transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=5)),
        root / "vit")
    wav2vec2 = save(transformers.Wav2Vec2ForSequenceClassification(transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, num_labels=4)),
        root / "wav2vec2")
    return {"bert": bert, "llama": llama, "vit": vit, "wav2vec2": wav2vec2}


@pytest.fixture(scope="session")
def hf_home(models, tmp_path_factory) -> pathlib.Path:
    """A Hugging Face cache holding the BERT directory as tiny-org/bert at REVISION."""
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--tiny-org--bert"
    shutil.copytree(models["bert"], repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return home


def manifest_of(out: pathlib.Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def signature(manifest: dict) -> tuple[dict, dict, dict]:
    """({input: (dtype, shape)}, {output: dtype}, {dim: (min, max)})."""
    sig = manifest["entry_points"]["serving_default"]["signature"]
    return ({spec["name"]: (spec["dtype"], spec["shape"]) for spec in sig["inputs"]}, {spec["name"]: spec["dtype"] for spec in sig["outputs"]},
            {dim["name"]: (dim["min"], dim["max"]) for dim in sig["dims"]})


def test_text_encoder_from_the_hf_cache_records_task_revision_and_tokenizer(models, hf_home, tmp_path):
    out = tmp_path / "bert.tpu"
    result = tpuexport("convert", "hf:tiny-org/bert", "--task", "text-classification", "--dim", "batch=1:4", "--dim", "seq=2:32",
                       "-o", out, *QUICK, env={"HF_HOME": str(hf_home)})
    assert result.returncode == 0, result.stderr
    # The command prints its progress and summary only: not torch's log of its own internals (torchao,
    # which transformers imports, registers enums the way torch 2.15 deprecates).
    assert not [line for line in result.stderr.splitlines() if "torch/" in line], result.stderr
    manifest = manifest_of(out)
    inputs, outputs, dims = signature(manifest)
    assert inputs == {"input_ids": ("int32", ["batch", "seq"]), "attention_mask": ("int32", ["batch", "seq"]),
                      "token_type_ids": ("int32", ["batch", "seq"])}
    assert outputs == {"logits": "float32"} and dims == {"batch": (1, 4), "seq": (2, 32)}
    assert manifest["verification"]["passed"]
    assert manifest["source"]["kind"] == "huggingface" and manifest["source"]["reference"] == "hf:tiny-org/bert --task text-classification"
    record = manifest["huggingface"]
    assert record["task"] == "text-classification" and record["architecture"] == "BertForSequenceClassification"
    assert record["revision"] == REVISION and len(record["config"]["id2label"]) == 3
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(record["files"])
    for name, relative in record["files"].items():
        assert (out / relative).read_bytes() == (models["bert"] / name).read_bytes() and relative in manifest["files"]
    # the weights streamed from the cached checkpoint
    assert "weights" in result.stderr
    inspected = tpuexport_in_process("inspect", out)
    assert inspected.returncode == 0 and "task text-classification, BertForSequenceClassification" in inspected.stdout
    assert "hf/tokenizer.json" in inspected.stdout


def test_decoder_lm_with_task_auto_is_a_generation_artifact(models, tmp_path):
    """--task auto on a causal LM is text-generation: prefill and decode entry points over a KV cache,
    verified against generate(), with the directory's generation config copied. (One prefill bucket, 2 x 8:
    the default's second prefill batch, 1, is test_generation.py's to check.)"""
    out = tmp_path / "llama.tpu"
    result = tpuexport_in_process("convert", models["llama"], "--max-batch", "2", "--max-context", "32", "--bucket", "seq=8",
                                  "--bucket", "batch=2", "--verify-new-tokens", "4", "-o", out, "--target", "cpu")
    assert result.returncode == 0, result.stderr
    manifest = manifest_of(out)
    assert manifest["huggingface"]["task"] == "text-generation" and "generation_config.json" in manifest["huggingface"]["files"]
    assert set(manifest["entry_points"]) == {"prefill", "decode", "sample"}
    assert manifest["generation"]["max_batch"] == 2 and manifest["generation"]["max_context"] == 32
    assert manifest["verification"]["passed"]
    # The weights streamed from the directory's checkpoint, once for both entry points.
    assert "streamed from the checkpoint" in result.stderr and manifest["source"]["checkpoint"] == "llama"
    refused = tpuexport_in_process("convert", models["llama"], "--dim", "batch=1:2", "-o", tmp_path / "x.tpu", *QUICK)
    assert refused.returncode == 2 and "--dim does not apply to --task text-generation" in refused.stderr


def test_a_multimodal_models_language_model_converts_alone_for_text_generation(tmp_path):
    """LLaVA's directory holds a vision tower, a projector and a Llama. --task text-generation converts
    the Llama alone (text in, text out), its tensors streamed from the LLaVA checkpoint under the
    Llama's names: here written in transformers' older layout (language_model.model.*), its LM head tied
    to the embeddings and so absent from the file. Its greedy tokens are LLaVA's own generate() on a
    text prompt (verification compares the Llama with itself: only this shows the right tensors were
    taken). --task auto names the task that converts it."""
    text = transformers.LlamaConfig(**TEXT, num_key_value_heads=2, tie_word_embeddings=True)
    vision = transformers.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, projection_dim=32)
    torch.manual_seed(0)
    llava = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=99, tie_word_embeddings=True)).eval()
    directory = save(llava, tmp_path / "llava")
    out = tmp_path / "llava.tpu"
    result = tpuexport_in_process("convert", directory, "--task", "text-generation", "--max-batch", "1", "--max-context", "32",
                                  "--bucket", "seq=8", "--verify-new-tokens", "4", "-o", out, "--target", "cpu")
    assert result.returncode == 0, result.stderr
    assert "streamed from the checkpoint" in result.stderr
    huggingface = manifest_of(out)["huggingface"]
    assert (huggingface["architecture"], huggingface["model_type"]) == ("LlamaForCausalLM", "llava")
    prompt = torch.randint(5, 99, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = llava.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, 8:].tolist()
    assert load(out).generate(prompt, 12, ignore_eos=True) == [expected]
    refused = tpuexport_in_process("convert", directory, "-o", tmp_path / "auto.tpu", "--target", "cpu")
    assert refused.returncode == 2 and "--task text-generation converts its language model alone" in refused.stderr


def test_a_multimodal_model_holding_the_whole_causal_lm_gives_its_tensors_under_one_prefix():
    """BLIP-2 holds a whole OPTForCausalLM (its LM head inside), where LLaVA holds a base model beside a
    head of its own (the test above): each of the causal LM's tensors, the tied head's name too, is the
    multimodal model's tensor of the same shape under `language_model.` (its decoder was once taken
    for the base model: a KeyError in the sweep's blip-2)."""
    from tpuexport.export.language_model import language_model_config, language_model_names

    config = transformers.Blip2Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "image_size": 32,
                       "patch_size": 8},
        qformer_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                        "encoder_hidden_size": 32},
        text_config={"model_type": "opt", "vocab_size": 100, "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "word_embed_proj_dim": 32}, num_query_tokens=4)
    with torch.device("meta"):
        multimodal = transformers.Blip2ForConditionalGeneration(config)
        model = transformers.AutoModelForCausalLM.from_config(language_model_config(config))
    names = language_model_names(multimodal, model)
    theirs = dict(multimodal.named_parameters(remove_duplicate=False))
    ours = dict(model.named_parameters(remove_duplicate=False))
    assert set(names) == set(ours) and "lm_head.weight" in names
    assert all(names[name] == f"language_model.{name}" and theirs[names[name]].shape == ours[name].shape for name in names)


def test_a_multimodal_model_is_built_as_the_class_its_directory_was_saved_from():
    """PP-Chart2Table saves a GotOcr2ForConditionalGeneration over a config class of its own, which no
    auto class maps to it: the language model was looked for in the image-text-to-text auto class,
    and the sweep's pp_chart2table crashed ("type object 'AutoModelForImageTextToText' has no
    attribute '_from_config'"). The saved class is built, and its Qwen2 found."""
    from tpuexport.export.language_model import language_model_config, language_model_names, multimodal_model

    config = transformers.AutoConfig.for_model("pp_chart2table", architectures=["GotOcr2ForConditionalGeneration"])
    config.text_config.update(dict(TEXT, num_key_value_heads=2))
    with torch.device("meta"):
        multimodal = multimodal_model(config, torch.float32)
        model = transformers.AutoModelForCausalLM.from_config(language_model_config(config))
    assert type(multimodal).__name__ == "GotOcr2ForConditionalGeneration" and type(model).__name__ == "Qwen2ForCausalLM"
    theirs, ours = dict(multimodal.named_parameters(remove_duplicate=False)), dict(model.named_parameters(remove_duplicate=False))
    names = language_model_names(multimodal, model)
    assert set(names) == set(ours) and all(theirs[mapped].shape == ours[name].shape for name, mapped in names.items())


def test_vision_classifier_with_task_auto(models, tmp_path):
    out = tmp_path / "vit.tpu"
    result = tpuexport_in_process("convert", models["vit"], "--task", "auto", "--dim", "batch=2:4", "-o", out, *QUICK)
    assert result.returncode == 0, result.stderr
    manifest = manifest_of(out)
    inputs, outputs, dims = signature(manifest)
    assert manifest["huggingface"]["task"] == "image-classification"
    assert inputs == {"pixel_values": ("float32", ["batch", 3, 32, 32])} and outputs == {"logits": "float32"}
    assert manifest["verification"]["passed"]


def test_audio_classifier_with_a_static_sample_count(models, tmp_path):
    out = tmp_path / "wav2vec2.tpu"
    result = tpuexport_in_process("convert", models["wav2vec2"], "--task", "audio-classification", "--dim", "batch=1:2", "--dim", "samples=400:400",
                       "-o", out, *QUICK)
    assert result.returncode == 0, result.stderr
    manifest = manifest_of(out)
    inputs, outputs, _ = signature(manifest)
    assert inputs == {"input_values": ("float32", ["batch", 400])} and outputs == {"logits": "float32"}
    assert manifest["verification"]["passed"]


def test_a_roberta_directory_converts_with_default_dims(tmp_path):
    """RoBERTa numbers positions from padding_idx + 1, so its longest input is max_position_embeddings
    - padding_idx - 1 (512 for roberta-base's 514): the default seq range stops there, where it was
    taken from max_position_embeddings literally and verification failed at its max case with an
    IndexError in eager PyTorch."""
    config = transformers.RobertaConfig(**{**TEXT, "max_position_embeddings": 66}, architectures=["RobertaForMaskedLM"])
    directory = save(transformers.RobertaForMaskedLM(config), tmp_path / "roberta")
    out = tmp_path / "roberta.tpu"
    result = tpuexport_in_process("convert", directory, "-o", out, "--target", "cpu", "--no-saved-model")
    assert result.returncode == 0, result.stderr
    manifest = manifest_of(out)
    assert signature(manifest)[2] == {"batch": (1, 64), "seq": (2, 64)} and manifest["huggingface"]["task"] == "fill-mask"
    assert manifest["verification"]["passed"]
    assert {"batch": 64, "seq": 64} in [case["sizes"] for case in manifest["verification"]["cases"]]


def test_a_directory_converts_at_the_seq_range_its_models_code_takes(tmp_path):
    """MobileBERT's trigram embedding pads a shifted copy of the sequence, which torch.export cannot
    trace at seq 2 (a guard `seq - 1 != 1`): the default range 2..64 is narrowed to what the code
    takes, 3..64, and the export line says so with the line of code (the batch the user gave stays).
    A --dim seq the user gave is not changed (the export's one-line refusal stands)."""
    config = transformers.MobileBertConfig(vocab_size=100, hidden_size=32, embedding_size=16, num_hidden_layers=1, num_attention_heads=4,
                                           intermediate_size=32, intra_bottleneck_size=16, true_hidden_size=16, max_position_embeddings=64,
                                           num_feedforward_networks=1)
    directory = save(transformers.MobileBertForMaskedLM(config), tmp_path / "mobilebert")
    out = tmp_path / "mobilebert.tpu"
    result = tpuexport_in_process("convert", directory, "--dim", "batch=2:4", "-o", out, "--target", "cpu", "--no-saved-model")
    assert result.returncode == 0, result.stderr
    manifest = manifest_of(out)
    assert signature(manifest)[2] == {"batch": (2, 4), "seq": (3, 64)} and manifest["verification"]["passed"]
    assert "dims seq 3..64: the model's code cannot take seq = 2, at " in result.stderr and "modeling_mobilebert.py" in result.stderr
    # The ranges a source may narrow are the ones it chose: with --dim seq given, the export's refusal stands.
    given = load_source(str(directory), dims=[parse_dim("seq=2:32")])
    assert given.at_ranges({"seq": (3, 32)}) is None
    args, dynamic_shapes, ranges = load_source(str(directory), dims=[parse_dim("batch=2:4")]).at_ranges({"seq": (3, 32)})
    assert ranges == {"seq": (3, 32)}
    assert args[0].shape[1] >= 3 and dynamic_shapes["input_ids"][1].min == 3 and dynamic_shapes["input_ids"][0].max == 4


def test_a_position_table_of_the_models_own_class_bounds_the_seq_range_too():
    """I-BERT keeps RoBERTa's offset positions in its own QuantEmbedding (not a torch.nn.Embedding):
    its longest input is found the same way, and it is exact (eager runs there, and fails one past)."""
    config = transformers.IBertConfig(**{**TEXT, "max_position_embeddings": 66})
    model = transformers.IBertForMaskedLM(config).eval()
    longest = longest_positions(model, config.max_position_embeddings)
    assert longest == 66 - config.pad_token_id - 1
    with torch.no_grad():
        model(torch.full((1, longest), 5))
        with pytest.raises(IndexError):
            model(torch.full((1, longest + 1), 5))


def test_a_model_missing_from_the_cache_is_one_line_exit_2(hf_home, tmp_path):
    missing = tpuexport("convert", "hf:tiny-org/absent", "-o", tmp_path / "x.tpu", env={"HF_HOME": str(hf_home)})
    lines = missing.stderr.strip().splitlines()
    assert missing.returncode == 2 and len(lines) == 1 and "Traceback" not in missing.stderr, missing.stderr
    assert str(hf_home / "hub" / "models--tiny-org--absent") in lines[0] and "never downloads" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_config_whose_code_cannot_be_imported_is_one_line_exit_2(tmp_path):
    """A model type whose code imports an optional package fails in transformers' AutoConfig when that
    package is missing or, as here, shadowed by a directory of its name where the command runs (the
    model's own directory named after its type: "xlstm")."""
    (tmp_path / "xlstm").mkdir()
    (tmp_path / "xlstm" / "config.json").write_text(json.dumps({"model_type": "xlstm"}))
    failed = tpuexport("convert", "xlstm", "-o", "x.tpu", cwd=tmp_path)
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode == 2 and len(lines) == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert "cannot import the code" in lines[0] and "'xlstm'" in lines[0] and "xLSTMConfig" in lines[0]
    assert not (tmp_path / "x.tpu").exists()


@pytest.mark.parametrize("source, task, expected", [
    ("nowhere/model-dir", "auto", "does not exist"),
    ("bert", "fly", "unknown task 'fly'; bert supports: feature-extraction, fill-mask, text-classification"),
    ("bert", "image-classification", "task 'image-classification' is not supported by bert; it supports: feature-extraction"),
    ("vit", "text-generation", "task 'text-generation' is not supported by vit; it supports: feature-extraction, image-classification"),
    ("empty", "auto", "has no config.json"),
])
def test_bad_input_names_the_problem(models, tmp_path, source, task, expected):
    (tmp_path / "empty").mkdir()
    reference = str(models[source]) if source in models else str(tmp_path / source)
    with pytest.raises(TpuExportError, match=expected.replace("(", r"\(")):
        load_source(reference, task=task)


def test_a_checkpoint_in_an_older_layout_streams_under_the_model_names(models):
    """transformers 5 renames ViT's attention weights when loading (save_pretrained writes the old
    names); the checkpoint is read under the new names, nothing is loaded in memory."""
    loaded = load_source(str(models["vit"]), task="image-classification")
    assert loaded.checkpoint is not None and loaded.model.model.vit.embeddings.cls_token.is_meta
    weight = loaded.checkpoint["model.vit.layers.0.attention.q_proj.weight"]
    assert torch.equal(weight, transformers.ViTForImageClassification.from_pretrained(models["vit"]).state_dict()[
        "vit.layers.0.attention.q_proj.weight"])


def test_a_bf16_checkpoint_builds_the_model_in_bf16(models, tmp_path):
    """The model is built in the dtype config.json records (what from_pretrained does), so a bf16
    checkpoint converts in bf16 by default and its tensors stream without a cast; a causal LM
    (text-generation) too."""
    bert = transformers.BertForSequenceClassification.from_pretrained(models["bert"], dtype=torch.bfloat16)
    bert.save_pretrained(tmp_path / "bert-bf16")
    loaded = load_source(str(tmp_path / "bert-bf16"))
    assert all(parameter.is_meta and parameter.dtype == torch.bfloat16 for parameter in loaded.model.parameters())
    name = next(name for name in loaded.checkpoint.keys() if name.endswith("layer.0.intermediate.dense.weight"))
    weight = loaded.checkpoint[name]
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, bert.bert.encoder.layer[0].intermediate.dense.weight)
    llama = transformers.LlamaForCausalLM.from_pretrained(models["llama"], dtype=torch.bfloat16)
    llama.save_pretrained(tmp_path / "llama-bf16")
    loaded = load_source(str(tmp_path / "llama-bf16"))
    assert all(parameter.is_meta and parameter.dtype == torch.bfloat16 for parameter in loaded.model.parameters())
    weight = loaded.checkpoint["model.layers.0.mlp.up_proj.weight"]
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, llama.model.layers[0].mlp.up_proj.weight)


def test_an_encoder_decoder_exports_without_a_cache_from_its_directory(tmp_path):
    """T5 gives its decoder a copy of the config, so turning use_cache off in the model's config
    alone left the decoder building a cache: its tensors became constants on the meta device and
    the conversion was refused. The forward is asked for no cache per call. Here a bf16 checkpoint
    (as most are published), which loads and exports in bf16 the same way (the per-call request does
    not depend on the dtype; float32 directories convert throughout this file)."""
    from tpuexport.export import capture

    dtype = torch.bfloat16

    directory = save(transformers.T5Model(transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0)).to(dtype), tmp_path / "t5")
    loaded = load_source(str(directory), task="feature-extraction")
    captured = capture(loaded)
    assert captured.reference.model.shared.weight.dtype == dtype
    assert not any(name.startswith("lifted_tensor") or ".lifted_tensor" in name for name in captured.program.constants)
    eager = captured.reference(*captured.example_inputs)
    assert eager["last_hidden_state"].shape[:2] == captured.example_inputs[2].shape
    assert not any("past_key_values" in name for name in eager)


def test_a_model_in_memory_converts_its_forward_as_its_directory_would(models, tmp_path):
    """A causal LM handed to convert() with example args returns a cache object from its own forward,
    which torch.export cannot output: it is called as a directory's model is (inputs by name, no
    cache built, its output tensors by field name), and the user's model is left as it was."""
    model = transformers.LlamaForCausalLM.from_pretrained(models["llama"]).eval()
    assert model.config.use_cache
    input_ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    seq = torch.export.Dim("seq", min=2, max=16)
    artifact = convert(model, (input_ids,), {"input_ids": {1: seq}}, target="cpu", out=tmp_path / "llama.tpu", saved_model=False,
                       verify_budget_flops=0)
    assert [spec["name"] for spec in artifact.manifest["entry_points"]["serving_default"]["signature"]["outputs"]] == ["logits"]
    assert artifact.manifest["verification"]["passed"] and model.config.use_cache
    tokens = input_ids[:, :5]
    outputs = artifact.run(tokens)
    with torch.no_grad():
        np.testing.assert_allclose(outputs["logits"].numpy(), model(tokens).logits.numpy(), rtol=1e-4, atol=1e-4)
