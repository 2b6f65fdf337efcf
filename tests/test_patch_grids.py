"""Vision towers over flattened patches and their grid (Qwen2-VL's descendants: Qwen3-VL, GLM-4V, ...)
convert from their directory at one image size: the grid is a constant of the program, the ops
that size tensors by its values are evaluated at export (export/constant_folding.py), and the
artifact takes one image's patches as the model's image processor writes them. Multimodal models
taking each image's size (Mistral 3's image_sizes) fix it alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tpuexport
from test_architectures import QUICK, error_lines
from test_cli import tpuexport_in_process
from tpuexport.export.constant_folding import fold_constants
from tpuexport.export.patch_grids import constants_read

transformers = pytest.importorskip("transformers")

PATCH, TEMPORAL, MERGE = 8, 2, 2


def convert_directory(directory, out, *options: str):
    """`tpuexport convert DIR -o OUT ...` in this process (no new interpreter's imports)."""
    return tpuexport_in_process("convert", directory, "-o", out, *options)


def converted_forward(model, tmp_path, name: str, *options: str) -> tuple[tpuexport.Runner, dict[str, dict]]:
    """The model saved to tmp_path / name and its forward converted for the cpu target (`options`: its
    --dim sizes): (a runner of the artifact, its signature's inputs by name, in order)."""
    model.save_pretrained(tmp_path / name)
    result = convert_directory(tmp_path / name, tmp_path / f"{name}.tpu", "--task", "feature-extraction", *options, *QUICK[2:],
                               "--target", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    runner = tpuexport.runner(tmp_path / f"{name}.tpu")
    return runner, {tensor["name"]: tensor for tensor in runner.artifact.manifest["entry_points"]["serving_default"]["signature"]["inputs"]}


def qwen3_vl_tower() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Qwen3VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                                              patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE,
                                              num_position_embeddings=64, deepstack_visual_indexes=[0])
    return transformers.Qwen3VLVisionModel(config).eval()


def qwen2_5_vl_tower() -> transformers.PreTrainedModel:
    """Qwen2.5-VL's tower attends within windows of 32 pixels (2 x 2 merged patches) but in its last block."""
    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                                                 patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE,
                                                 window_size=32, fullatt_block_indexes=[1])
    return transformers.Qwen2_5_VisionTransformerPretrainedModel(config).eval()


@pytest.fixture(scope="module")
def tower_directory(tmp_path_factory):
    """A tiny Qwen3-VL vision tower written by save_pretrained, with its model."""
    model = qwen3_vl_tower()
    directory = tmp_path_factory.mktemp("tower") / "qwen3_vl_vision"
    model.save_pretrained(directory)
    return directory, model


def test_a_vision_tower_converts_at_one_image_size_and_runs_what_the_model_computes(tower_directory, tmp_path):
    """A 64 x 32 image: 8 rows x 4 columns of patches, so a grid read in the wrong order differs."""
    directory, model = tower_directory
    out = tmp_path / "tower.tpu"
    result = convert_directory(directory, out, "--task", "auto", "--dim", "height=64:64", "--dim", "width=32:32",
                               *QUICK[2:], "--target", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    runner = tpuexport.runner(out)
    signature = runner.artifact.manifest["entry_points"]["serving_default"]["signature"]
    assert [(tensor["name"], tensor["shape"]) for tensor in signature["inputs"]] == [("hidden_states", [32, 3 * TEMPORAL * PATCH * PATCH])]
    assert {tensor["name"] for tensor in signature["outputs"]} >= {"last_hidden_state", "pooler_output", "deepstack_features_0"}
    patches = torch.randn(32, 3 * TEMPORAL * PATCH * PATCH)
    outputs = runner.run({"hidden_states": patches.numpy()})
    with torch.no_grad():
        expected = model(patches, grid_thw=torch.tensor([[1, 8, 4]]))
    np.testing.assert_allclose(outputs["pooler_output"], expected.pooler_output.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(outputs["deepstack_features_0"], expected.deepstack_features[0].numpy(), atol=1e-4, rtol=1e-4)


def test_a_tower_attending_within_windows_converts_with_its_windows_computed_at_export(tmp_path):
    """Qwen2.5-VL selects its windows with a boolean mask torch.export cannot trace: they are computed
    eagerly from the grid and given to the tower; 64 x 64 pixels make 2 x 2 windows, so a window
    order read wrongly differs."""
    model = qwen2_5_vl_tower()
    model.save_pretrained(tmp_path / "qwen2_5_vl_vision")
    result = convert_directory(tmp_path / "qwen2_5_vl_vision", tmp_path / "tower.tpu", "--task", "auto", "--dim", "height=64:64",
                               "--dim", "width=64:64", *QUICK[2:], "--target", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    patches = torch.randn(64, 3 * TEMPORAL * PATCH * PATCH)
    outputs = tpuexport.runner(tmp_path / "tower.tpu").run({"hidden_states": patches.numpy()})
    with torch.no_grad():
        expected = model(patches, grid_thw=torch.tensor([[1, 8, 8]]))
    np.testing.assert_allclose(outputs["pooler_output"], expected.pooler_output.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dim, message", [
    ("height=60:60", "--dim height=60:60: this vision tower converts at one image size, in whole merged patches of 16 pixels"),
    ("width=32:64", "--dim width=32:64: this vision tower converts at one image size"),
    ("seq=2:16", "--dim seq is not a dim of this model; its dims are height, width"),
])
def test_an_image_size_the_tower_cannot_take_is_one_line(tower_directory, tmp_path, dim, message):
    directory, _ = tower_directory
    result = convert_directory(directory, tmp_path / "tower.tpu", "--task", "auto", "--dim", dim, *QUICK)
    assert result.returncode == 2
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert not (tmp_path / "tower.tpu").exists()


class Grid(torch.nn.Module):
    """Sizes from a constant's values, as a tower's attention boundaries are: rows repeated by counts."""

    def forward(self, x):
        counts = torch.tensor([1, 3, 2])
        repeated = torch.repeat_interleave(torch.arange(3), counts)
        return x * repeated[None, :] + counts.sum()


def test_ops_computing_from_constants_alone_are_evaluated_at_export():
    x = torch.randn(2, 6)
    with constants_read():
        program = torch.export.export(Grid(), (x,))
    folded = fold_constants(program)
    assert [node.target for node in folded.graph.nodes if node.op == "call_function"] == [torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor]
    assert torch.equal(folded.module()(x), Grid()(x))
    decomposed = folded.run_decompositions()  # a trace that cannot read the constant's values: none left to read
    assert torch.equal(decomposed.module()(x), Grid()(x))


def tiny_mistral3() -> transformers.PreTrainedModel:
    """Mistral 3: a Pixtral tower (patches of 8) whose features for a 32 x 32 image, merged 2 x 2, are 4 placeholder tokens."""
    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16, patch_size=8,
                  image_size=32)
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, max_position_embeddings=64)
    config = transformers.Mistral3Config(vision_config=vision, text_config=text, image_token_index=100, spatial_merge_size=2)
    return transformers.Mistral3Model(config).eval()


class Selected(torch.nn.Module):
    """Rows kept by a mask comparing a range with a constant's values (LFM2-VL's tokens of each image),
    scaled by weights computed from constants in place (SigLIP 2's `abs_()`)."""

    def forward(self, x):
        sizes = torch.tensor([2, 3])
        kept = torch.arange(x.shape[0]) < sizes.prod()
        weights = (torch.arange(x.shape[1]) - sizes.sum().float()).abs_()
        return x[kept] * weights


def test_a_mask_from_constants_selects_known_rows_and_constants_written_in_place_stay_computed():
    x = torch.randn(8, 4)
    with constants_read():
        program = torch.export.export(Selected(), (x,))
    folded = fold_constants(program)
    indexes = [node for node in folded.graph.nodes if node.target is torch.ops.aten.index.Tensor]
    assert len(indexes) == 1 and all(index.meta["val"].dtype == torch.int64 for index in indexes[0].args[1])  # positions, no mask
    assert torch.ops.aten.abs_.default in [node.target for node in folded.graph.nodes]
    assert folded.module()(x).shape == (6, 4) and torch.equal(folded.module()(x), Selected()(x))
    assert torch.equal(folded.run_decompositions().module()(x), Selected()(x))


def test_a_model_taking_each_images_size_converts_with_the_size_fixed(tmp_path):
    """image_sizes is no input of the artifact: the program fixes it to the one image size it takes."""
    model = tiny_mistral3()
    runner, inputs = converted_forward(model, tmp_path, "mistral3")
    assert list(inputs) == ["input_ids", "pixel_values", "attention_mask"]
    ids = torch.randint(1, 99, (1, 16))  # the compiled bucket's length
    ids[0, 3:7] = 100  # its 4 placeholder tokens
    pixels = torch.randn(1, 3, 32, 32)
    outputs = runner.run({"input_ids": ids.numpy(), "pixel_values": pixels.numpy(), "attention_mask": np.ones((1, 16), np.int64)})
    with torch.no_grad():
        expected = model(input_ids=ids, pixel_values=pixels, image_sizes=torch.tensor([[32, 32]])).last_hidden_state
    np.testing.assert_allclose(outputs["last_hidden_state"], expected.numpy(), atol=1e-4, rtol=1e-4)
    refused = convert_directory(tmp_path / "mistral3", tmp_path / "m3b.tpu", "--task", "feature-extraction", "--dim", "batch=1:4", *QUICK)
    lines = error_lines(refused.stderr)
    assert refused.returncode == 2 and len(lines) == 1 and "takes each image's size (image_sizes)" in lines[0], refused.stderr[-2000:]


def tiny_llava_next_video() -> transformers.PreTrainedModel:
    """LLaVA-NeXT-Video: images tiled at any resolution (tiles of 32 for pinpoints up to 64 x 64) and video
    clips, whose features come flattened to the forward's scatter."""
    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=8, image_size=32)
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=512)
    config = transformers.LlavaNextVideoConfig(vision_config=vision, text_config=text, image_token_index=100, video_token_index=101,
                                               image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]], vision_feature_layer=-1,
                                               spatial_pool_stride=2)
    return transformers.LlavaNextVideoModel(config).eval()


def test_images_tiled_at_any_resolution_convert_with_their_size_fixed(tmp_path):
    """A 64 x 64 image is 4 tiles of 32 and the whole image at 32: pixel_values [1, 5, 3, 32, 32]. Each
    placeholder count is the model's own (the video's 8 frames of 2 x 2 pooled features, 32 tokens, reach
    the scatter flattened)."""
    model = tiny_llava_next_video()
    runner, inputs = converted_forward(model, tmp_path, "llava_next_video", "--dim", "height=64:64", "--dim", "width=64:64")
    assert inputs["pixel_values"]["shape"] == [1, 5, 3, 32, 32] and inputs["pixel_values_videos"]["shape"] == [1, 8, 3, 32, 32]
    counts = {placeholder["media"]: placeholder["count"] for placeholder in inputs["input_ids"]["placeholders"]}
    assert counts["pixel_values_videos"] == 8 * 2 * 2
    length = runner.artifact.manifest["targets"]["cpu"]["buckets"][0]["sizes"]["seq"]  # the one compiled: the placeholders and a text token
    ids = torch.randint(1, 99, (1, length))
    ids[0, 1:1 + counts["pixel_values"]] = 100
    ids[0, 1 + counts["pixel_values"]:] = 101
    pixels, clips = torch.randn(1, 5, 3, 32, 32), torch.randn(1, 8, 3, 32, 32)
    outputs = runner.run({"input_ids": ids.numpy(), "pixel_values": pixels.numpy(), "pixel_values_videos": clips.numpy(),
                          "attention_mask": np.ones((1, length), np.int64)})
    with torch.no_grad():
        expected = model(input_ids=ids, pixel_values=pixels, pixel_values_videos=clips, image_sizes=torch.tensor([[64, 64]])).last_hidden_state
    np.testing.assert_allclose(outputs["last_hidden_state"], expected.numpy(), atol=1e-4, rtol=1e-4)


def test_a_naflex_tower_converts_at_one_image_size_over_a_batch_of_images(tmp_path):
    """SigLIP 2's NaFlex classifier at 32 x 48 pixels (2 x 3 patches of 16, so transposed spatial_shapes
    differ): spatial_shapes is a constant every image shares, no patch mask is given (every patch is the
    image's: the model's output with an all-ones mask), the batch stays a dim."""
    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=16, num_patches=16)
    model = transformers.Siglip2ForImageClassification(transformers.Siglip2Config(vision_config=vision, num_labels=3)).eval()
    model.save_pretrained(tmp_path / "siglip2")
    result = convert_directory(tmp_path / "siglip2", tmp_path / "siglip2.tpu", "--task", "auto", "--dim", "height=32:32", "--dim",
                               "width=48:48", "--dim", "batch=1:2", *QUICK[2:], "--target", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    runner = tpuexport.runner(tmp_path / "siglip2.tpu")
    inputs = runner.artifact.manifest["entry_points"]["serving_default"]["signature"]["inputs"]
    assert [(tensor["name"], tensor["shape"]) for tensor in inputs] == [("pixel_values", ["batch", 6, 3 * 16 * 16])]
    patches = torch.randn(2, 6, 3 * 16 * 16)  # the cpu target's bucket
    logits = runner.run({"pixel_values": patches.numpy()})["logits"]
    with torch.no_grad():
        expected = model(pixel_values=patches, pixel_attention_mask=torch.ones(2, 6, dtype=torch.long),
                         spatial_shapes=torch.tensor([[2, 3]] * 2)).logits
    np.testing.assert_allclose(logits, expected.numpy(), atol=1e-4, rtol=1e-4)


def tiny_qwen2_vl() -> transformers.PreTrainedModel:
    """Qwen2-VL: patches of 8 pixels merged 2 x 2, multimodal rotary sections summing to half the text's head dim."""
    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=8, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    return transformers.Qwen2VLModel(config).eval()


def test_a_model_numbering_positions_over_its_image_grid_takes_them_as_an_input(tmp_path):
    """Qwen2-VL's multimodal rotary positions (a frame, row and column per token) come from the token ids'
    values in Python loops: the program takes them as position_ids [3, 1, seq], the grid of one 32 x 32
    image fixed, its 16 patches flattened. Given the positions the model's own get_rope_index computes for
    an image placed where a chat template puts it, the artifact computes what the model does unprompted."""
    model = tiny_qwen2_vl()
    runner, inputs = converted_forward(model, tmp_path, "qwen2_vl", "--dim", "height=32:32", "--dim", "width=32:32")
    assert inputs["position_ids"]["shape"] == [3, 1, "seq"] and inputs["pixel_values"]["shape"] == [16, 3 * 2 * 8 * 8]
    assert [placeholder["count"] for placeholder in inputs["input_ids"]["placeholders"]] == [4]  # 4 x 4 patches merged 2 x 2
    length = runner.artifact.manifest["targets"]["cpu"]["buckets"][0]["sizes"]["seq"]
    ids = torch.randint(1, 99, (1, length))
    ids[0, 2], ids[0, 3:7], ids[0, 7] = 102, 100, 103  # text, the vision start, the image's 4 tokens, the vision end, text
    grid, pixels = torch.tensor([[1, 4, 4]]), torch.randn(16, 3 * 2 * 8 * 8)
    positions, _ = model.get_rope_index(ids, mm_token_type_ids=(ids == 100).int(), image_grid_thw=grid)
    assert positions[:, 0, -1].tolist() == [length - 3] * 3  # past the image, text positions step over its 4 tokens' 2 x 2 grid
    outputs = runner.run({"input_ids": ids.numpy(), "attention_mask": np.ones((1, length), np.int64), "position_ids": positions.numpy(),
                          "pixel_values": pixels.numpy()})
    with torch.no_grad():
        expected = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == 100).int()).last_hidden_state
    np.testing.assert_allclose(outputs["last_hidden_state"], expected.numpy(), atol=1e-4, rtol=1e-4)
