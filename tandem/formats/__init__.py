"""Run-time formats: per-group integer weights and the FP8/INT8 KV cache, as the kernels, layers,
KV cache and model read them. Below every layer that reads them; imports nothing of tandem/.
"""
