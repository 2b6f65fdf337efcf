"""Telling the user's code from torch's in the stack traces torch records while tracing."""

from __future__ import annotations

import os
import re

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)')


def is_user_code(filename: str) -> bool:
    """Whether a traced frame's file is the user's (the model's, or a library it calls) rather than
    torch's own or code torch generated while tracing ("<eval_with_key>.5")."""
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(_TORCH_DIR)


def user_source(node: torch.fx.Node) -> str:
    """The innermost frame of the node's stack trace that is the user's code, not torch's."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    user_frames = [frame for frame in frames if is_user_code(frame[0])]
    if user_frames:
        path, line, code = user_frames[-1]
        return f"{path}:{line} ({code.strip()})"
    module_stack = node.meta.get("nn_module_stack") or {}
    if module_stack:
        path, module_type = list(module_stack.values())[-1]
        return f"module {path or '<root>'} ({getattr(module_type, '__name__', module_type)})"
    return "unknown source line"
