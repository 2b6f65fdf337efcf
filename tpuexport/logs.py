"""Silencing library loggers whose messages users cannot act on."""

import contextlib
import logging

# Importing torchao (PT2E quantization; transformers imports it too when building a model) on a
# CPU-only machine logs warnings about its optional CUDA kernels and an Enum registration.
TORCHAO_LOGGERS = ("torchao", "torch.utils._pytree")
# torch.export's fake tensors log the traceback of an operator that fails on them, and torch.export
# logs a classified failure, at ERROR level before the failure reaches tpuexport, which reports it in
# one line.
EXPORT_LOGGERS = ("torch._subclasses.fake_tensor", "torch.export._trace")


@contextlib.contextmanager
def quiet_loggers(*names: str, level: int = logging.ERROR):
    """Raises these loggers to `level` for the block, restoring their levels after."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
