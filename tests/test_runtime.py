"""The cpu target and the runtime: XLA:CPU executables compiled like the TPU ones, their compile key,
loaded without compiling in a fresh process, padded to buckets, and refused on a mismatched key."""

from __future__ import annotations

import datetime
import json

import pytest

from tpuexport.artifact import layout
from tpuexport.compile.compile_key import compile_key, host_cpu, key_difference
from tpuexport.verify.gate import WARNING, PASSED, check_compatibility


def test_cpu_target_compiles_every_bucket_with_figures_and_a_compile_key(mlp_cpu_artifact):
    entry = mlp_cpu_artifact.manifest["targets"]["cpu"]

    assert entry["platform"] == "cpu"
    assert [bucket["name"] for bucket in entry["buckets"]] == ["batch1", "batch4", "batch8"]
    for bucket in entry["buckets"]:
        assert (mlp_cpu_artifact.path / bucket["executable"]).stat().st_size > 0
        assert bucket["memory"]["argument_bytes"] > 0 and bucket["cost"]["flops"] > 0
    # More rows, more FLOPs: the figures are XLA's for each bucket.
    assert entry["buckets"][0]["cost"]["flops"] < entry["buckets"][2]["cost"]["flops"]
    key = entry["compile_key"]
    assert key["platform"] == "cpu" and key["device_kind"] == "cpu" and key["devices"] == 1
    assert key["versions"]["jaxlib"] and key["compiler_options"]
    assert key["serialization_version"] == mlp_cpu_artifact.manifest["program"]["serialization"]["serialization_version"]
    assert key["cpu"] == host_cpu() and key["cpu"]["features"]


def test_key_difference_names_each_field_that_differs(mlp_cpu_artifact):
    recorded = mlp_cpu_artifact.manifest["targets"]["cpu"]["compile_key"]
    host = compile_key("cpu", "cpu", 1, None, recorded["compiler_options"], recorded["calling_convention_version"])

    assert key_difference(recorded, host) == ""
    older = json.loads(json.dumps(recorded))
    older["versions"]["jaxlib"] = "0.4.1"
    older["cpu"]["features"].append("avx10_2")
    difference = key_difference(older, host)
    assert f"jaxlib 0.4.1 (artifact) vs {recorded['versions']['jaxlib']} (host)" in difference
    assert "lacks avx10_2" in difference


def test_compatibility_warns_when_the_jax_export_window_is_near_or_past(mlp_cpu_artifact):
    recorded = mlp_cpu_artifact.manifest["program"]["serialization"]
    until = datetime.date.fromisoformat(recorded["loadable_until"])
    assert until > datetime.date.fromisoformat(recorded["version_date"])

    early = check_compatibility(mlp_cpu_artifact, today=until - datetime.timedelta(days=200))
    near = check_compatibility(mlp_cpu_artifact, today=until - datetime.timedelta(days=10))
    past = check_compatibility(mlp_cpu_artifact, today=until + datetime.timedelta(days=3))

    assert early.status == PASSED and "200 days left" in early.message
    assert near.status == WARNING and "in 10 days" in near.message and str(until) in near.message
    assert past.status == WARNING and "3 days ago" in past.message and "convert again" in past.message
