"""What an artifact offers to run: its entry points, each a signature with compiled buckets.

A single-forward artifact holds one program, offered as the entry point "serving_default" (TF
Serving's signature name, so a server maps a request's signature_name to it). A text-generation
artifact lists its entry points (prefill, decode) in the manifest's "entry_points", each with its
signature and state (the KV cache: inputs returned as outputs of the same name, kept on the device
between calls); its buckets name their entry point. Everything above this module works per entry
point.
"""

from __future__ import annotations

import dataclasses

from tpuexport.errors import TpuExportError
from tpuexport.signature import ProgramSignature

DEFAULT_ENTRY_POINT = "serving_default"


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


def entry_points(manifest: dict, target: str) -> dict[str, EntryPoint]:
    """The artifact's entry points with their buckets for one target.

    Args:
      manifest: the artifact's manifest.
      target: a target name among manifest["targets"].
    Returns:
      {name: EntryPoint}.
    """
    recorded = manifest["targets"][target]["buckets"]
    if "entry_points" in manifest:
        # Exact sizes only: no padded bucket is verified for these entry points.
        return {
            name: EntryPoint(name, ProgramSignature.from_json(entry["signature"]), _buckets(b for b in recorded if b.get("entry_point") == name),
                             None, "generation entry points run at their compiled sizes", tuple(entry.get("state", {})))
            for name, entry in manifest["entry_points"].items()
        }
    signature = ProgramSignature.from_json(manifest["signature"])
    dim = signature.batch_dim()
    padding = manifest.get("padding")
    note = ""
    if dim is None:
        note = "the program has no batch dim shared by every input and output"
    elif padding is None:
        note = "no padded bucket was verified (the artifact predates padding checks, or no bucket is ever padded)"
    elif not padding["passed"]:
        note = "padding the batch dim failed verification (manifest padding)"
    return {DEFAULT_ENTRY_POINT: EntryPoint(DEFAULT_ENTRY_POINT, signature, _buckets(recorded), None if note else dim, note)}


def _buckets(recorded) -> tuple[BucketEntry, ...]:
    buckets = (BucketEntry(entry["name"], dict(entry["sizes"]), entry["executable"], tuple(entry.get("state_as_bits", ())))
               for entry in recorded)
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
