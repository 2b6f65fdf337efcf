"""The files of a Hugging Face source that a serving stack needs beside the program (tokenizer,
processor, generation defaults, chat template), which the artifact carries in hf/. Apart from
huggingface.py so that the runtime reads them without importing torch."""

from __future__ import annotations

# Copied into the artifact's hf/ directory when the source has them.
SERVING_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "preprocessor_config.json", "processor_config.json", "chat_template.jinja", "chat_template.json",
)
ARTIFACT_DIRECTORY = "hf"


def is_tokenizer_file(name: str) -> bool:
    """Whether a serving file is one of a tokenizer's."""
    return name.startswith("tokenizer") or name in ("vocab.txt", "vocab.json", "spiece.model")
