"""A Hugging Face source's serving files in the artifact: tokenizer, processor and generation
config copied into hf/, and the manifest's "huggingface" section (task, config, revision)."""

from __future__ import annotations

import pathlib
import shutil
from typing import Callable

from tpuexport.export.huggingface import HuggingFaceInfo
from tpuexport.export.serving_files import ARTIFACT_DIRECTORY


def huggingface_writer(record: HuggingFaceInfo) -> Callable[[pathlib.Path], dict]:
    """An extra writer (see write_artifact) for a Hugging Face source.

    Args:
      record: the source's HuggingFaceInfo; its file names are fixed names (SERVING_FILES), so
        the copies stay inside the artifact.
    Returns:
      A callable (staging directory) -> {"huggingface": section} that copies the files.
    """

    def write(staging: pathlib.Path) -> dict:
        directory = staging / ARTIFACT_DIRECTORY
        directory.mkdir()
        for name, path in sorted(record.files.items()):
            shutil.copyfile(path, directory / pathlib.PurePath(name).name)  # follows the cache's symlinks to the blobs
        return {"huggingface": record.manifest_section()}

    return write
