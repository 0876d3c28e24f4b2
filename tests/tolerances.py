"""How far two float32 computations of one model's logprobs may differ on any CPU.

The product computes a place's row over its KV cache, in forwards of other shapes and another
summation order than one full forward of the model (and a CPU of another kind sums in other orders
again: 1.09e-4 was seen where these tests once asked 1e-4). A sum of n float32 terms in another
order moves by about sqrt(n)·eps of its terms' magnitude (rounding as a random walk); each layer
adds its own, the LM head one more, and the log-softmax's shift and both computations' rounding
count four times over. Scaled by the rows' largest magnitude: a wrong row or token is off by
tenths or more, far past it."""

from __future__ import annotations

import math

EPS32 = 2.0 ** -23  # torch.finfo(torch.float32).eps


def float32_tolerance(config, values) -> float:
    """The absolute tolerance for logprobs of magnitude up to max(|values|) (finite ones) of a model
    with this config (hidden_size, num_hidden_layers)."""
    largest = max((abs(float(v)) for v in values if v is not None and math.isfinite(float(v))), default=1.0)
    return 4 * EPS32 * config.hidden_size ** 0.5 * (config.num_hidden_layers + 1) * max(largest, 1.0)
