"""The jax.export compatibility window recorded in manifests counts from the installed JAX's release."""

from __future__ import annotations

import datetime

import jax

from tpuexport.compile.compile_key import JAX_RELEASE_DATES, SERIALIZATION_VERSION_DATES, export_compatibility


def test_the_pinned_jax_release_starts_the_window():
    # A JAX upgrade that forgets JAX_RELEASE_DATES falls back to the serialization version's date,
    # months earlier: every new artifact would then warn too soon in `tpuexport verify`.
    assert jax.__version__ in JAX_RELEASE_DATES
    record = export_compatibility()
    released = JAX_RELEASE_DATES[jax.__version__]
    assert record["jax_version"] == jax.__version__
    assert record["jax_release_date"] == released.isoformat()
    assert record["serialization_version"] in SERIALIZATION_VERSION_DATES
    assert record["version_date"] <= record["jax_release_date"]
    until = datetime.date.fromisoformat(record["loadable_until"])
    assert (until.year * 12 + until.month) - (released.year * 12 + released.month) == 6
    assert until.day == min(released.day, 28)


def test_an_unknown_jax_release_falls_back_to_the_serialization_version_date(monkeypatch):
    monkeypatch.delitem(JAX_RELEASE_DATES, jax.__version__)
    record = export_compatibility(written_on=datetime.date(2030, 1, 1))
    assert record["jax_release_date"] is None
    start = SERIALIZATION_VERSION_DATES[record["serialization_version"]]
    assert record["version_date"] == start.isoformat()
    assert datetime.date.fromisoformat(record["loadable_until"]) < datetime.date(2030, 1, 1)
