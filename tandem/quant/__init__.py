"""`tandem quantize`, the offline quantization tool: recipes, calibration (AWQ, GPTQ, AutoRound,
end-to-end tuning), checkpoints. The formats it writes are in `tandem.formats`.

Submodules are imported where used; this package imports nothing heavy on its own.
"""
