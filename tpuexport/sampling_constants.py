"""The sample entry point's constants, shared by its torch module (export/sampling.py), its lowering
and NumPy reference (lower/sampling.py) and the OpenAI server, in a module that imports nothing: the
runtime and servers use them without importing torch."""

# The alternatives returned per row (OpenAI's chat API allows up to 20 top_logprobs).
TOP_LOGPROBS = 20
# Halvings of a row's value range that find a top-k or top-p threshold: adjacent float32 values for
# logits within a few hundred of each other (values closer than the range / 2^40 count as tied).
BISECTION_STEPS = 40
