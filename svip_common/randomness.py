"""Per-request randomness keyed by (seed, position, purpose).

Every random draw of a request is a pure function of its seed, the output position it settles and
what it is for, so a seeded request reproduces whatever the pipeline's timing, and no global RNG
is touched inside the token loop. The mixer is SplitMix64, whose outputs pass BigCrush.
"""

import dataclasses
import enum

_MASK = (1 << 64) - 1


class Purpose(enum.IntEnum):
    DRAFT = 1  # the draft samples its token at this position
    ACCEPT = 2  # the accept / reject coin for the drafted token at this position
    RESOLVE = 3  # the target samples this position (correction or bonus)
    BRANCH = 4  # a token tree: the coin for this position's sibling (its index among them)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, position: int, purpose: Purpose, index: int = 0) -> float:
    """A uniform draw in [0, 1) with 53 random bits, fixed by its keys (index: the draw's among
    several of one purpose at one position; 0 leaves the three-key draw as it always was)."""
    x = _splitmix64(seed & _MASK)
    x = _splitmix64(x ^ (position & _MASK))
    x = _splitmix64(x ^ int(purpose))
    if index:
        x = _splitmix64(x ^ (index & _MASK))
    return (x >> 11) * (1.0 / (1 << 53))


def sample_seed(seed: int, index: int) -> int:
    """Seed of the index-th of n independent samples of one prompt (index 0 keeps the seed)."""
    return (seed + index) & ((1 << 63) - 1)


def choices(request, n: int) -> list:
    """The n independent samples of one request (a GenerationRequest): the i-th is the request
    alone with seed sample_seed(seed, i), so each reproduces as a single request."""
    return [dataclasses.replace(request, sampling=dataclasses.replace(request.sampling,
                                                                      seed=sample_seed(request.sampling.seed, i)))
            for i in range(n)]
