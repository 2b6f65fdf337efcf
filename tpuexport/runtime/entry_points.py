"""What an artifact offers to run: its entry points, each a signature with compiled buckets.

Every artifact lists its entry points in the manifest (artifact/records.py): a forward model's one
is "serving_default" (TF Serving's signature name, so a server maps a request's signature_name to
it); a text-generation artifact's fill and advance a cache, their state (inputs returned as outputs
of the same name, kept on the device between calls). Each says whether a dim pads to the next
bucket. Everything above this module works per entry point.
"""

from __future__ import annotations

import dataclasses

from tpuexport.artifact.records import BucketRecord, Manifest
from tpuexport.errors import TpuExportError
from tpuexport.signature import ProgramSignature


@dataclasses.dataclass(frozen=True)
class BucketEntry:
    """One compiled bucket as the manifest records it.

    Attributes:
      name: the bucket's name ("batch8").
      sizes: {dim: size}.
      executable: the executable's path inside the artifact.
      state_as_bits: the bfloat16 state inputs/outputs the executable takes and returns as uint16
        bit patterns (an XLA:CPU executable's KV cache; compile/aot.py, cpu_executable_program).
    """

    name: str
    sizes: dict[str, int]
    executable: str
    state_as_bits: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class EntryPoint:
    """A callable program of the artifact.

    Attributes:
      name: how requests name it ("serving_default").
      signature: its inputs, outputs and dims.
      buckets: its compiled buckets for the chosen target, smallest batch first.
      batch_dim: the dim padded to the next bucket (the signature's batch dim, when the padded
        bucket passed verification), or None: then only exact bucket sizes run.
      padding_note: why the batch dim is not padded, or "" when it is.
      state: outputs that are the next call's inputs of the same name (a KV cache): returned as
        device arrays, so that passing them back costs no copy.
    """

    name: str
    signature: ProgramSignature
    buckets: tuple[BucketEntry, ...]
    batch_dim: str | None
    padding_note: str = ""
    state: tuple[str, ...] = ()


def entry_points(manifest: Manifest, target: str, version_set: str | None = None) -> dict[str, EntryPoint]:
    """The artifact's entry points with their buckets for one target.

    Args:
      manifest: the artifact's manifest records.
      target: a target name among its targets.
      version_set: a compile environment's version set of that target, or None for its own executables.
    Returns:
      {name: EntryPoint}.
    """
    return {name: EntryPoint(name, entry.signature, _buckets(manifest.buckets(target, name, version_set)), entry.padded_dim,
                             entry.padding_note,
                             entry.state)
            for name, entry in manifest.entry_points.items()}


def _buckets(recorded: tuple[BucketRecord, ...]) -> tuple[BucketEntry, ...]:
    buckets = (BucketEntry(bucket.name, dict(bucket.sizes), bucket.executable, bucket.state_as_bits) for bucket in recorded)
    return tuple(sorted(buckets, key=lambda bucket: tuple(bucket.sizes.values())))


def choose_bucket(entry: EntryPoint, sizes: dict[str, int]) -> BucketEntry:
    """The smallest bucket that holds a request of these dim sizes.

    Args:
      entry: the entry point.
      sizes: the request's dim sizes (ProgramSignature.sizes_of).
    Returns:
      The bucket: every dim equal, except the batch dim (when it pads), which may be larger.
    Raises:
      TpuExportError: no bucket holds it (naming the compiled sizes).
    """
    for bucket in sorted(entry.buckets, key=lambda b: b.sizes.get(entry.batch_dim, 0) if entry.batch_dim else 0):
        fits = all(
            (size >= sizes[name]) if name == entry.batch_dim else (size == sizes[name])
            for name, size in bucket.sizes.items()
        )
        if fits:
            return bucket
    asked = ", ".join(f"{name}={size}" for name, size in sizes.items())
    compiled = "; ".join(", ".join(f"{name}={size}" for name, size in b.sizes.items()) for b in entry.buckets)
    padding = (f"; smaller {entry.batch_dim} sizes pad up to the next one" if entry.batch_dim
               else f"; exact sizes only: {entry.padding_note}" if entry.padding_note else "")
    raise TpuExportError(f"{asked} is outside every compiled bucket ({compiled}{padding}); send sizes a bucket holds, "
                         "or convert with larger --bucket sizes")
