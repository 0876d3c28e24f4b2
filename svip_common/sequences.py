"""Token sequences compared: how much two of them share from the start. No torch."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items two token lists share: one list comparison (in C) when all do (the
    usual case: one extends the other), a walk from the start only when they differ."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])
