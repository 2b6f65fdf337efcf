"""What an artifact offers to run: its entry points, each a signature with compiled buckets.

Today an artifact holds one program, offered as the entry point "serving_default" (TF Serving's
signature name, so a server maps a request's signature_name to it). Artifacts with several entry
points (a generator's prefill and decode) add more; everything above this module works per entry
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
    """

    name: str
    sizes: dict[str, int]
    executable: str


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
    """

    name: str
    signature: ProgramSignature
    buckets: tuple[BucketEntry, ...]
    batch_dim: str | None
    padding_note: str = ""


def entry_points(manifest: dict, target: str) -> dict[str, EntryPoint]:
    """The artifact's entry points with their buckets for one target.

    Args:
      manifest: the artifact's manifest.
      target: a target name among manifest["targets"].
    Returns:
      {name: EntryPoint}.
    """
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
    buckets = sorted(
        (BucketEntry(entry["name"], dict(entry["sizes"]), entry["executable"]) for entry in manifest["targets"][target]["buckets"]),
        key=lambda bucket: tuple(bucket.sizes.values()),
    )
    return {DEFAULT_ENTRY_POINT: EntryPoint(DEFAULT_ENTRY_POINT, signature, tuple(buckets), None if note else dim, note)}


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
