"""Silencing library loggers whose messages users cannot act on."""

import contextlib
import logging

# Importing torchao (PT2E quantization; transformers imports it too when building a model) on a
# CPU-only machine logs warnings about its optional CUDA kernels and an Enum registration.
TORCHAO_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_loggers(*names: str):
    """Raises these loggers to ERROR for the block, restoring their levels after."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
