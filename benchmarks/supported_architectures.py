"""The model types the architectures sweep converted, as a page: docs/supported-architectures.md.

    python benchmarks/supported_architectures.py > docs/supported-architectures.md

Reads the sweep's recorded f32 runs (benchmarks/results/architectures/history/*.txt but bf16_* and
language_models_*): the shards' runs in the order benchmarks/results/architectures/summary.md lists
them, then the re-runs after fixes (fixes_*, rerun_*, fixed_*) in the same order, so that a type's row
after a fix replaces the row a shard's run gave it with older code (within one file, a later row
replaces an earlier one). Prints each outcome's types with the task `--task auto` chose, and the
counts; then the multimodal types' language models (`--language-models` runs, language_models_*).
"""

from __future__ import annotations

import collections
import pathlib
import re

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "architectures"
# A row of architectures.py's table: type, task, outcome, eager (a column since session 14's runs), seconds, first line of any failure.
ROW = re.compile(r"^(\S+)\s+(\S+)\s+(passed|refused|failed|crashed|not built)\s+(?:(?:yes|no|-)\s+)?[\d.]+\s*(.*)$")
HEADINGS = {"passed": "Converted and verified", "refused": "Refused in one line", "failed": "Failed verification",
            "crashed": "Crashed", "not built": "Not built tiny by the sweep (not a judgement of the architecture)"}

# The refusals' classes, first match wins: (class, why tpuexport refuses it and what converts instead, pattern of the line).
REFUSAL_CLASSES = (
    ("multimodal placeholders not countable", "the model's features method (get_image_features, ...), which counts the placeholder "
     "tokens a row holds, needs inputs tpuexport does not make (image sizes, tile grids, masks), fails at the tiny config, or makes "
     "a number of features that depends on its inputs' values; its language model or one tower converts alone",
     r"placeholder tokens cannot be counted|to count them"),
    ("decoder layers keeping no KV cache", "states the entry points do not hold: recurrent states kept outside transformers' cache "
     "(RWKV, xLSTM, RecurrentGemma), short convolutions writing their own kept inputs (Zaya's), layer types no mask "
     "describes, forwards taking no cache; the full-sequence forward may convert at a fixed length",
     r"keeps a recurrent state|keeping both keys and a recurrent state|recurrent layers whose|has \w+ layers, which the|takes no KV cache"
     r"|no num_hidden_layers"),
    ("none of the known inputs", "the model takes none of input_ids, pixel_values, input_values, input_features (trackers, "
     "time series, VQ models, towers wanting grid sizes); a file.py:factory gives its inputs", r"takes none of"),
    ("inputs the forward needs that tpuexport does not make", "the forward requires more arguments than the known inputs "
     "(image grid sizes, queries, labels); a file.py:factory gives them",
     r"missing \d+ required positional argument|in its forward, which tpuexport does not make"),
    ("the tiny model's forward fails on the inputs", "the model's own eager forward fails at the example sizes, before tpuexport "
     "does anything: the tiny config or the inputs do not suit it (extra inputs such as bbox or grid_thw; other sizes)",
     r"the model's own forward fails"),
    ("a size the model's code fixes or bounds", "torch.export found the model's code taking one size, or a range, of a dim "
     "declared dynamic; the line names the code and the --dim range that converts",
     r"fixes \w+ at|cannot take|needs \w+ in|needs \w+ = |declare \w+ (static|that range)"),
    ("sizes or branches from tensor values", "the model's code computes a size or takes a branch from tensor values (MoE loops "
     "over routed experts, value-dependent splits), which one exported program cannot hold; the line names the code",
     r"tensor values|on values|value-dependent|data-dependent|random numbers"),
    ("a decoder attending bidirectionally", "earlier tokens' keys change as tokens are added, so no KV cache can hold them",
     r"attends bidirectionally"),
    ("an op JAX lowers at fixed sizes only", "JAX cannot lower the op for the TPU over a symbolic size (FNet's FFT over the sequence); "
     "the line names the --dim that makes the dim static, with which it converts", r"at fixed sizes only"),
)


def refusal_class(message: str) -> str:
    """The class of a refusal's line (REFUSAL_CLASSES), or "other"."""
    return next((name for name, _, pattern in REFUSAL_CLASSES if re.search(pattern, message)), "other")


def latest_rows(language_models: bool = False) -> dict[str, tuple[str, str, str]]:
    """{model type: (task, outcome, first line of any failure)} from the recorded runs (module docstring):
    the f32 `--task auto` runs, or with `language_models` the `--language-models` runs."""
    linked = list(dict.fromkeys(re.findall(r"\(history/([^)]+\.txt)\)", (RESULTS / "summary.md").read_text())))
    # The f32 --task auto runs only: a --bf16-checkpoint run's rows (bf16_*) and a --language-models run's are other modes'.
    files = [name for name in linked + sorted(path.name for path in (RESULTS / "history").glob("*.txt") if path.name not in linked)
             if name.startswith("language_models") == language_models and not name.startswith("bf16")]
    rows = {}
    for name in sorted(files, key=lambda name: (name.startswith(("fix", "rerun")), files.index(name))):
        for line in (RESULTS / "history" / name).read_text().splitlines():
            match = ROW.match(line)
            if match:
                rows[match[1]] = (match[2], match[3], match[4])
    return rows


def main() -> None:
    rows = latest_rows()
    by_outcome = collections.defaultdict(list)
    for model_type, (task, outcome, message) in sorted(rows.items()):
        by_outcome[outcome].append((model_type, task, message))
    counts = ", ".join(f"{len(by_outcome[outcome])} {outcome}" for outcome in HEADINGS)
    print("# Supported architectures\n")
    print("What `tpuexport convert DIR --task auto --target v5e` did with a tiny random model of each transformers model type")
    print("the architectures sweep has run (`benchmarks/architectures.py`; its runs, dates and code are listed in")
    print("[benchmarks/results/architectures/summary.md](../benchmarks/results/architectures/summary.md)). A type's latest row counts.")
    print("Generated by `python benchmarks/supported_architectures.py`.\n")
    print(f"{len(rows)} types: {counts}.\n")
    for outcome, heading in HEADINGS.items():
        if not by_outcome[outcome]:
            continue
        print(f"## {heading} ({len(by_outcome[outcome])})\n")
        if outcome == "passed":
            tasks = collections.defaultdict(list)
            for model_type, task, _ in by_outcome[outcome]:
                tasks[task].append(f"`{model_type}`")
            for task, names in sorted(tasks.items()):
                print(f"- **{task}** ({len(names)}): {', '.join(names)}")
        else:
            if outcome == "refused":
                print_refusal_classes(by_outcome[outcome])
            for model_type, task, message in by_outcome[outcome]:
                print(f"- `{model_type}` ({task}): {message[:200].replace('|', '/')}")
        print()
    print_language_models(latest_rows(language_models=True))


def print_language_models(rows: dict[str, tuple[str, str, str]]) -> None:
    """The multimodal types whose language model `--task text-generation` converts alone, by outcome."""
    if not rows:
        return
    outcomes = collections.Counter(outcome for _, outcome, _ in rows.values())
    print(f"## Language models of multimodal types ({len(rows)})\n")
    print("`--task text-generation` on the directory of a multimodal model's `...ForConditionalGeneration` converts its language")
    print("model alone, text in and text out (`benchmarks/architectures.py --language-models`; docs/huggingface.md): "
          f"{', '.join(f'{outcomes[outcome]} {outcome}' for outcome in HEADINGS)}.\n")
    for model_type, (_, outcome, message) in sorted(rows.items()):
        print(f"- `{model_type}`: {outcome}" + (f": {message[:200].replace('|', '/')}" if message else ""))
    print()


def print_refusal_classes(refused: list[tuple[str, str, str]]) -> None:
    """The refusals counted by class, each with why it is refused; "other" lists its types."""
    classes = collections.defaultdict(list)
    for model_type, _, message in refused:
        classes[refusal_class(message)].append(model_type)
    print("| class | types | why |")
    print("| --- | --- | --- |")
    for name, why, _ in REFUSAL_CLASSES:
        print(f"| {name} | {len(classes[name])} | {why} |")
    print(f"| other | {len(classes['other'])} | torch.export or the lowering stopping inside the model's code at the example sizes, "
          "with the torch or JAX message (each below; not looked into one by one) |\n")


if __name__ == "__main__":
    main()
