"""Types of the serving API that the gateway and the engine share: sampling parameters and
structured output (`sampling_params.py`), request checks (`validation.py`, and `structured.py`
for grammars), reported log-probabilities (`logprobs.py`) and incremental detokenization
(`detokenizer.py`).

Nothing here imports torch, triton or the engine, so the gateway uses them freely; import the
modules themselves (this package loads nothing)."""
