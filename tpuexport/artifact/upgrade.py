"""Reading manifests of earlier format versions: each is upgraded, in memory, to the current one.

The files stay where the older writer put them (the manifest names every path), so an upgrade only
moves manifest entries. The history of the format is in docs/artifact-format.md.
"""

from __future__ import annotations

import copy

from tpuexport.errors import TpuExportError
from tpuexport.signature import ProgramSignature
from tpuexport.verify.row_padding import padding_policy

# Version 2 (tpuexport before 2026-11-27): a forward artifact held one program (top-level "signature",
# program files under "program"); a text-generation one its "entry_points". Both are entry points now.
FORWARD_ENTRY_POINT = "serving_default"
GENERATION_PADDING_NOTE = "generation entry points run at their compiled sizes"


def upgraded(manifest: dict, current: int) -> dict:
    """The manifest in the current format.

    Args:
      manifest: a parsed manifest.json of any version this tpuexport reads.
      current: the current format version.
    Returns:
      The manifest as the current writer would have written it (a copy; older versions upgraded).
    Raises:
      TpuExportError: a version this tpuexport does not read.
    """
    version = manifest.get("format_version")
    if version == current:
        return manifest
    if version == 2 and current == 3:
        return _from_version_2(copy.deepcopy(manifest))
    raise TpuExportError(f"artifact format version {version!r} is not one this tpuexport reads (it reads 2 and {current}); "
                         "install the tpuexport that wrote it, or convert again")


def _from_version_2(manifest: dict) -> dict:
    """Version 2 -> 3: a forward program becomes the entry point "serving_default"; every entry point
    records its padding; a slice's sharding plans move to the target, per entry point."""
    generation = "entry_points" in manifest
    if not generation:
        program = manifest["program"]
        signature = manifest.pop("signature")
        padding = manifest.get("padding")
        dim, note = padding_policy(ProgramSignature.from_json(signature), None if padding is None else padding["passed"])
        manifest["entry_points"] = {FORWARD_ENTRY_POINT: {
            **{key: program.pop(key) for key in ("exported", "mlir_text", "stablehlo_bytecode") if key in program},
            "signature": signature, "matmul_flops": program.pop("matmul_flops"), "decision_matmuls": program.pop("decision_matmuls", []),
            "donated_inputs": [], "state": {}, "padding": {"dim": dim, "note": note}}}
        program.pop("call", None)
        kernels = manifest.get("kernels")
        if isinstance(kernels, dict) and isinstance(kernels.get("programs"), dict):
            kernels["programs"] = {f"{FORWARD_ENTRY_POINT}/{name}": path for name, path in kernels["programs"].items()}
    else:
        for entry in manifest["entry_points"].values():
            entry["padding"] = {"dim": None, "note": GENERATION_PADDING_NOTE}
    manifest["task"] = manifest.get("task", "forward")
    for target in manifest["targets"].values():
        plans = {}
        if "sharding" in target:
            plans[FORWARD_ENTRY_POINT] = target.pop("sharding")
        for bucket in target.get("buckets", []):
            bucket.setdefault("entry_point", FORWARD_ENTRY_POINT)
            if "sharding" in bucket:
                plans.setdefault(bucket["entry_point"], bucket.pop("sharding"))
        if plans:
            buckets = target.pop("buckets")
            target["sharding"], target["buckets"] = plans, buckets
    manifest["format_version"] = 3
    return manifest
