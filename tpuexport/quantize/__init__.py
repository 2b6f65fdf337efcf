"""Quantize pass: PT2E int8 quantization (torchao) with a TPU quantizer and integer lowerings."""

import contextlib
import logging


@contextlib.contextmanager
def _quiet_loggers(*names: str):
    """Raises these loggers to ERROR for the block: importing torchao on a CPU-only machine logs
    warnings about its optional CUDA kernels and an Enum registration, which users cannot act on."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


with _quiet_loggers("torchao", "torch.utils._pytree"):
    from tpuexport.quantize.quantization import QuantizedLayer, QuantizedModel, quantize
    from tpuexport.quantize.quantizer import MODES, TpuQuantizer

__all__ = ["MODES", "QuantizedLayer", "QuantizedModel", "TpuQuantizer", "quantize"]
