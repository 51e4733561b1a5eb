"""How long an engine step takes for a given number of tokens, learned from measured steps.

Step time is modelled as `fixed + per_token * tokens`, fitted by exponentially weighted least
squares (recent steps count most), so the scheduler can ask how many tokens fit in a
time-per-output-token target. With too little spread in the observed token counts to separate
the two terms, the model falls back to time proportional to tokens, which over-estimates larger
steps (the safe side for a latency target).
"""

from __future__ import annotations


class StepTimeModel:
    """EWMA fit of step seconds against tokens computed in the step."""

    def __init__(self, alpha: float = 0.05, min_samples: int = 8) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.min_samples = min_samples
        self.samples = 0
        self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self.samples += 1
        # Plain running means until 1/alpha samples, then exponential weighting.
        a = max(self.alpha, 1.0 / self.samples)
        x, y = float(tokens), seconds
        self._x += a * (x - self._x)
        self._y += a * (y - self._y)
        self._xx += a * (x * x - self._xx)
        self._xy += a * (x * y - self._xy)

    @property
    def ready(self) -> bool:
        return self.samples >= self.min_samples

    @property
    def mean_step_s(self) -> float:
        """EWMA of the step time."""
        return self._y

    def coefficients(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before `min_samples` steps."""
        if not self.ready:
            return None
        var = self._xx - self._x * self._x
        if var > 1e-6 * max(1.0, self._x * self._x):
            per = (self._xy - self._x * self._y) / var
            fixed = self._y - per * self._x
            if per > 0 and fixed >= 0:
                return fixed, per
        return 0.0, self._y / self._x

    def predict(self, tokens: int) -> float | None:
        c = self.coefficients()
        return None if c is None else c[0] + c[1] * tokens

    def max_tokens(self, seconds: float) -> int | None:
        """The most tokens a step may hold to take at most `seconds` (None: not learned yet)."""
        c = self.coefficients()
        if c is None:
            return None
        fixed, per = c
        return max(0, int((seconds - fixed) / per))
