"""Defaults the command line shows in its --help, in a module that imports nothing: the CLI reads them
when it is imported, before (and often without) importing the stages that use them."""

# FLOPs verification's optional cases may add: about a second of matmuls per run on two CPU cores
# (verify/sizes.py).
DEFAULT_BUDGET_FLOPS = 5e10
