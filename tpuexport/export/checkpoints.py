"""Weights from a checkpoint, read one tensor at a time, never all in memory.

A conversion from a checkpoint builds the model with its parameters on the meta device
(`parameters_on_meta`), exports and lowers it from shapes, and reads the weights only to stream
them into the artifact and to run the eager reference. Tensors are views into private memory maps
of the checkpoint files: their pages are file-backed, so the kernel reads them on first touch and
drops them under memory pressure instead of the process holding the model.

Checkpoint forms:
  - a `.safetensors` file;
  - a directory with a `*.safetensors.index.json` (Hugging Face's sharded layout: "weight_map"
    from name to shard file), or else every `*.safetensors` file in it;
  - a `.pt` / `.pth` / `.bin` state_dict, read with `torch.load(weights_only=True, mmap=True)`
    (tensors only: no code runs);
  - any Mapping from state_dict name to tensor (e.g. one a factory returns that loads each tensor
    when asked for it).
"""

from __future__ import annotations

import contextlib
import copy
import json
import pathlib
from collections.abc import Mapping
from typing import Any

import torch

from tpuexport.safetensors_files import SAFETENSORS_DTYPES, read_safetensors_header
from tpuexport.errors import TpuExportError
from tpuexport.memory import MemoryBudget, gib

PICKLED_STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin")
# Names listed when the checkpoint and the model disagree (the rest are counted).
LISTED_NAMES = 5


class Checkpoint(Mapping):
    """State_dict name -> tensor, each read when asked for (a read-only Mapping).

    Attributes:
      description: where the tensors come from, for messages.
      name: what the manifest records: the file or directory name (not where it lives), or the
        description for a Mapping.
    """

    def __init__(self, tensors: Mapping, description: str, name: str | None = None):
        self._tensors = tensors
        self.description = description
        self.name = name or description

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        if not isinstance(tensor, torch.Tensor):
            raise TpuExportError(f"the checkpoint's {name!r} is a {type(tensor).__name__}, not a tensor; give tensors only")
        return tensor

    def __contains__(self, name) -> bool:
        return name in self._tensors  # without reading the tensor

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def release(self) -> None:
        """Unmaps the checkpoint's files once no tensor of theirs is held (a tensor asked for later maps
        its file again); a Mapping the user gave, or a pickled state_dict, is left as it is."""
        if isinstance(self._tensors, _SafetensorsFiles):
            self._tensors.release()

    def mapped_regions(self) -> list[tuple[int, int]]:
        """(start, end) addresses of the file maps its tensors are views of now (safetensors files'; a
        Mapping the user gave, or a pickled state_dict, has none this package knows)."""
        return self._tensors.mapped_regions() if isinstance(self._tensors, _SafetensorsFiles) else []


class _SafetensorsFiles(Mapping):
    """Tensors of safetensors files by name, as views into one private memory map per file."""

    def __init__(self, file_of: dict[str, pathlib.Path]):
        self._file_of = file_of
        self._maps: dict[pathlib.Path, tuple[torch.Tensor, dict]] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        data, header = self._mapped(self._file_of[name])
        if name not in header:
            raise TpuExportError(f"{self._file_of[name].name} has no tensor {name!r}, which the checkpoint's index puts there; "
                                 "give the checkpoint's complete, matching files")
        entry = header[name]
        start, end = entry["data_offsets"]
        dtype = getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]])
        raw = data[start:end]
        if raw.storage_offset() % dtype.itemsize:  # a view needs whole elements; this one tensor is copied
            raw = raw.clone()
        return raw.view(dtype).view(entry["shape"])

    def __contains__(self, name) -> bool:
        return name in self._file_of

    def __iter__(self):
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def release(self) -> None:
        self._maps.clear()

    def mapped_regions(self) -> list[tuple[int, int]]:
        return [(data.data_ptr(), data.data_ptr() + data.numel()) for data, _ in self._maps.values()]

    def _mapped(self, path: pathlib.Path) -> tuple[torch.Tensor, dict]:
        if path not in self._maps:
            header, data_start = read_safetensors_header(path)
            size = path.stat().st_size
            # shared=False: a private, copy-on-write mapping; the file is never written.
            storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
            whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,))
            self._maps[path] = (whole[data_start:], header)
        return self._maps[path]


def open_checkpoint(source: Any) -> Checkpoint:
    """The Checkpoint a --checkpoint path (or a Python Mapping) names.

    Args:
      source: a path (str or PathLike) to a safetensors file, a directory of them (with or
        without an index), or a .pt/.pth/.bin state_dict; or a Mapping name -> tensor.
    Returns:
      The Checkpoint (nothing but headers is read yet).
    Raises:
      TpuExportError: a missing path, a directory without safetensors, a bad index or header.
    """
    if isinstance(source, Checkpoint):
        return source
    if isinstance(source, Mapping):
        return Checkpoint(source, f"a {type(source).__name__} of {len(source)} tensors")
    path = pathlib.Path(source)
    if path.is_dir():
        return Checkpoint(_SafetensorsFiles(_directory_files(path)), str(path), path.name)
    if not path.is_file():
        raise TpuExportError(f"checkpoint {path} does not exist; give a .safetensors file, a directory of them, or a .pt state_dict")
    if path.suffix.lower() == ".safetensors":
        header, _ = read_safetensors_header(path)
        return Checkpoint(_SafetensorsFiles(dict.fromkeys(header, path)), str(path), path.name)
    if path.suffix.lower() in PICKLED_STATE_DICT_SUFFIXES:
        return Checkpoint(_load_state_dict(path), str(path), path.name)
    raise TpuExportError(f"checkpoint {path} has an unknown kind {path.suffix or '(no suffix)'!r}; "
                         "give .safetensors, a directory of them, or a .pt/.pth/.bin state_dict")


def _directory_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """{tensor name: shard file} of a checkpoint directory, from its index or its files' headers."""
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise TpuExportError(f"checkpoint directory {directory} has {len(indexes)} indexes ({', '.join(p.name for p in indexes)}); "
                             "give the directory of one checkpoint")
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as error:
            raise TpuExportError(f"cannot read {indexes[0]} ({type(error).__name__}: {error}); it needs a \"weight_map\" "
                                 "from tensor name to shard file") from None
        missing = sorted({file for file in weight_map.values() if not (directory / file).is_file()})
        if missing:
            raise TpuExportError(f"{indexes[0].name} names shard(s) missing from {directory}: {', '.join(missing[:LISTED_NAMES])}; "
                                 "copy the whole checkpoint")
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise TpuExportError(f"checkpoint directory {directory} has no .safetensors files; save the weights with safetensors")
    return {name: file for file in files for name in read_safetensors_header(file)[0]}


def stored_weight_bytes(directory: pathlib.Path) -> int:
    """The bytes of a model directory's weights, from its safetensors headers (no tensor is read), or
    the sizes of its pickled state_dict files when it has no safetensors."""
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return sum(int(entry["data_offsets"][1]) - int(entry["data_offsets"][0])
                   for file in files for entry in read_safetensors_header(file)[0].values())
    return sum(path.stat().st_size for suffix in PICKLED_STATE_DICT_SUFFIXES for path in directory.glob(f"*{suffix}"))


def check_weights_fit(weight_bytes: int, what: str, budget: MemoryBudget | None, fix: str) -> None:
    """Refuses, before they are read, weights that will be held in memory and alone exceed the budget.

    Args:
      weight_bytes: their size (from headers or file sizes).
      what: what holds them, for the message ("the weights of DIR").
      budget: the conversion's memory budget, or None (nothing is refused).
      fix: how to convert the model within it, ending the message.
    Raises:
      TpuExportError: they do not fit.
    """
    if budget is not None and budget.bytes is not None and weight_bytes > budget.bytes:
        raise TpuExportError(f"{what}, {gib(weight_bytes)}, would be read into memory and alone exceed the memory budget of "
                             f"{budget.describe()}; {fix}")


def _load_state_dict(path: pathlib.Path) -> dict:
    try:
        # weights_only: tensors and containers only, no code runs; mmap: tensors stay in the file.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # torch raises many kinds (unpickling refused, zip, version)
        raise TpuExportError(f"cannot read {path} as a state_dict of tensors ({type(error).__name__}: "
                             f"{str(error).splitlines()[0][:200]}); save it with torch.save(model.state_dict()) or as safetensors") from None
    if not isinstance(state, Mapping):
        raise TpuExportError(f"{path} holds a {type(state).__name__}, not a state_dict; save model.state_dict()")
    return state


@contextlib.contextmanager
def parameters_on_meta():
    """Within it, every parameter a module registers is moved to the meta device (buffers stay
    real: models compute some, like rotary frequencies, when built, and checkpoints often lack
    them). Building a model costs no memory for its parameters, whatever its size.

    nn.Module.register_parameter is replaced while the context is open and restored on exit.
    """
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def with_checkpoint_weights(model: torch.nn.Module, checkpoint: Checkpoint) -> torch.nn.Module:
    """A copy of `model` whose parameters and buffers are the checkpoint's tensors.

    Tensors the checkpoint has replace the model's (meta or not); tied weights (one tensor under
    several names) get one tensor for all their names, from whichever name the checkpoint has.
    A model that wraps the checkpoint's (`self.model = LlamaForCausalLM(...)` to pick outputs)
    finds its tensors under its names with the wrapper's prefix ("model.") removed. A tensor in
    another dtype than the model's is cast (that one is then a copy in memory).

    Args:
      model: the nn.Module, its parameters typically on the meta device.
      checkpoint: the weights.
    Returns:
      The copy, in eval mode, ready to run (the original is not changed).
    Raises:
      TpuExportError: the checkpoint lacks tensors the model has on the meta device, or holds one
        of another shape (all such names listed, up to a few).
    """
    model = copy.deepcopy(model).eval()
    state = _named_state(model)
    prefix = _wrapper_prefix([name for names, _, _ in state for name in names], checkpoint)
    missing, misshapen = [], []
    for names, tensor, is_parameter in state:
        found = next((name.removeprefix(prefix) for name in names if name.removeprefix(prefix) in checkpoint), None)
        if found is None:
            if tensor.is_meta:
                missing.append(names[0])
            continue
        value = checkpoint[found]
        if tuple(value.shape) != tuple(tensor.shape):
            misshapen.append(f"{found} {tuple(value.shape)} (model {tuple(tensor.shape)})")
            continue
        value = value.to(tensor.dtype)
        replacement = torch.nn.Parameter(value, requires_grad=False) if is_parameter else value
        for name in names:
            owner, _, leaf = name.rpartition(".")
            slots = model.get_submodule(owner)._parameters if is_parameter else model.get_submodule(owner)._buffers
            slots[leaf] = replacement
    if missing:
        raise TpuExportError(f"checkpoint {checkpoint.description} has no tensor for {len(missing)} of the model's weights "
                             f"({_listed(missing)}); give the checkpoint of this model (names as in model.state_dict())")
    if misshapen:
        raise TpuExportError(f"checkpoint {checkpoint.description} holds {len(misshapen)} tensor(s) of another shape than the "
                             f"model's: {_listed(misshapen)}; give the checkpoint of this model's configuration")
    return model


def share_parameters(modules, replacements: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Points the parameters of `modules` that hold one of `replacements`' first tensors' memory (the
    same data pointer, shape, strides and dtype: the same checkpoint tensor, under any Parameter
    object wrapping it) at the second tensor's memory, in place (`Parameter.data`), so that every
    holder of those Parameter objects reads the new memory. Buffers are left alone: a model may
    write its buffers, and the replacements may be read-only.

    Args:
      modules: the nn.Modules (copies this package made, never the user's).
      replacements: (old tensor, new tensor holding the same values).
    Returns:
      The bytes of the distinct tensors replaced.
    """
    new_of = {_memory_key(old): new for old, new in replacements}
    replaced = {}
    for module in modules:
        for parameter in module.parameters():
            new = new_of.get(_memory_key(parameter))
            if new is not None:
                parameter.data = new
                replaced[new.data_ptr()] = new.numel() * new.element_size()
    return sum(replaced.values())


def _memory_key(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype


def _wrapper_prefix(names: list[str], checkpoint: Checkpoint) -> str:
    """The leading module path ("", "model.", "model.model.", ...) whose removal from the model's
    names matches the most checkpoint names (ties: the shortest)."""
    candidates = {""} | {".".join(name.split(".")[:depth]) + "." for name in names[:1] for depth in range(1, name.count(".") + 1)}
    matches = {prefix: sum(name.startswith(prefix) and name.removeprefix(prefix) in checkpoint for name in names) for prefix in candidates}
    return max(sorted(candidates, key=len), key=lambda prefix: matches[prefix])


def _named_state(model: torch.nn.Module) -> list[tuple[list[str], torch.Tensor, bool]]:
    """(every name of one tensor, the tensor, whether it is a parameter) per distinct parameter
    and buffer, in registration order."""
    groups: dict[int, tuple[list[str], torch.Tensor, bool]] = {}
    for is_parameter, named in ((True, model.named_parameters(remove_duplicate=False)),
                                (False, model.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            groups.setdefault(id(tensor), ([], tensor, is_parameter))[0].append(name)
    return list(groups.values())


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:LISTED_NAMES])
    return shown + (f" and {len(names) - LISTED_NAMES} more" if len(names) > LISTED_NAMES else "")


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the model with every parameter and buffer on the meta device, tied ones still one
    tensor (Module.to("meta") makes a new Parameter per name, which unties them), but the integer
    scalars its code computes sizes from (constant_scalar)."""
    model = copy.deepcopy(model)
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (original, kept alive so ids stay unique; meta)
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for name, tensor in slots.items():
                if tensor is not None and not tensor.is_meta:
                    if slots is module._buffers and constant_scalar(module, name, tensor):
                        continue  # a constant of the code, read as a number while exporting (capturing._scalar_buffers_as_constants)
                    if id(tensor) not in moved:
                        meta = tensor.to("meta")
                        if isinstance(tensor, torch.nn.Parameter):
                            meta = type(tensor)(meta, requires_grad=tensor.requires_grad)
                        moved[id(tensor)] = (tensor, meta)
                    slots[name] = moved[id(tensor)][1]
    return model


def constant_scalar(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Whether a buffer is an integer scalar the model computed when it was built and keeps out of its
    checkpoint (non-persistent): a constant of its code, such as the stride and kernel size EnCodec's,
    Mimi's and Pocket TTS's convolutions compute their padding from."""
    return (name in module._non_persistent_buffers_set and tensor.dim() == 0 and not tensor.is_meta
            and not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool))
