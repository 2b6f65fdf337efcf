"""Telling the user's code from torch's in the stack traces torch records while tracing."""

from __future__ import annotations

import os

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)


def is_user_code(filename: str) -> bool:
    """Whether a traced frame's file is the user's (the model's, or a library it calls) rather than
    torch's own or code torch generated while tracing ("<eval_with_key>.5")."""
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(_TORCH_DIR)
