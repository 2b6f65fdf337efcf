"""Sampling on the device: the sample entry point (export/sampling.py) lowered as the pipeline lowers it
draws exactly what the NumPy reference draws for the same keys, and its draws follow the
distributions Hugging Face's logits processors define (verify/sampling.py); a planted wrong
temperature and a top-p one token short fail that verification."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpuexport import export as export_stage
from tpuexport import lower as lower_stage
from tpuexport.export import sampling as export_sampling
from tpuexport.export.sampling import Sample, sample_example_arguments
from tpuexport.lower.lowering import decompose
from tpuexport.lower.sampling import Draw, Sampling, sample_reference, sampling_inputs
from tpuexport.verify.sampling import DESIGNS, DRAWS, EXACT_ROWS, verify_sampling

VOCAB = 256


def lowered(module: torch.nn.Module) -> lower_stage.LoweredProgram:
    args, dynamic_shapes = sample_example_arguments(VOCAB)
    captured = export_stage.capture(export_stage.LoadedSource(module, args, dynamic_shapes, None, export_stage.SourceInfo("api")))
    return lower_stage.lower(captured.program, captured.signature, precision="f32")


class MultipliedTemperature(Sample):
    """Multiplies the logits by the temperature instead of dividing them."""

    def scale(self, logits, temperature):
        return logits * temperature[:, None]


class TopPOneTokenShort(Sample):
    """Keeps one token fewer than top-p should: the last token it keeps (the one whose probability
    takes the kept mass to p) is dropped."""

    def p_floor(self, masked, top_p):
        floor = super().p_floor(masked, top_p)
        return torch.where(masked > floor, masked, torch.full_like(masked, torch.inf)).min(-1, keepdim=True).values


@pytest.fixture(scope="module")
def sample_program():
    return lowered(Sample(VOCAB))


def test_the_sample_entry_point_draws_what_the_reference_and_hugging_face_define(sample_program):
    report = verify_sampling(sample_program.run, VOCAB)
    assert report.passed, report.failure_summary()
    assert report.rows == EXACT_ROWS and not report.greedy_mismatches and report.top_ids_equal
    assert len(report.distributions) == len(DESIGNS) and all(check.draws >= DRAWS == 10_000 for check in report.distributions)
    # A row's draws are keyed by its seed and step, not by where it sits among the rows.
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, VOCAB)).astype(np.float32) * 4
    draws = [Draw(Sampling(0.9, 0.8, 40), key, step) for key, step in ((11, 0), (11, 1), (-5, 0), (12, 3))]
    tokens = sample_program.run([logits, *sampling_inputs(draws, 4)])[0]
    reversed_tokens = sample_program.run([logits[::-1].copy(), *sampling_inputs(draws[::-1], 4)])[0]
    assert list(tokens) == list(reversed_tokens[::-1]) == list(sample_reference(logits, *sampling_inputs(draws, 4))["tokens"])


@pytest.mark.parametrize("planted, design", [(MultipliedTemperature, 0), (TopPOneTokenShort, 2)], ids=["temperature", "top-p"])
def test_planted_sampling_bugs_fail_verification(planted, design):
    report = verify_sampling(lowered(planted(VOCAB)).run, VOCAB)
    check = report.distributions[design]
    assert not report.passed and not check.passed and check.distance > 2 * check.bound, check.describe()
    assert not report.exact_passed  # the reference draws otherwise too


def test_one_sample_program_per_vocabulary_in_a_process_each_conversion_its_own_decomposition():
    """Every text-generation conversion of a vocabulary takes the process's one sample program. It is
    decomposed once, and each conversion gets a copy: a pass that rewrites one in place leaves the next alike."""
    program = export_sampling.sample_program(VOCAB)
    assert export_sampling.sample_program(VOCAB) is program and export_sampling.sample_program(VOCAB + 1) is not program
    first = decompose(program)
    code = first.graph_module.code
    output = next(node for node in first.graph.nodes if node.op == "output")
    first.graph.erase_node(output)  # a rewrite in place
    second = decompose(program)
    assert second is not first and second.graph_module.code == code
