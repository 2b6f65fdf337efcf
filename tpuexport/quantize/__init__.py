"""Quantize pass: PT2E int8 quantization (torchao) with a TPU quantizer and integer lowerings."""

from tpuexport.logs import TORCHAO_LOGGERS, quiet_loggers

with quiet_loggers(*TORCHAO_LOGGERS):
    from tpuexport.quantize.quantization import QuantizedLayer, QuantizedModel, quantize
    from tpuexport.quantize.quantizer import MODES, TpuQuantizer

__all__ = ["MODES", "QuantizedLayer", "QuantizedModel", "TpuQuantizer", "quantize"]
