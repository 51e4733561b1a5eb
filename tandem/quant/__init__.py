"""Quantization: INT4/INT8 per-group weights (format, recipes, AWQ calibration, the
`tandem quantize` tool) and the FP8/INT8 KV cache.

Submodules are imported where used; this package imports nothing heavy on its own.
"""
