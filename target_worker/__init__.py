"""The target side: verification of draft blocks (greedy and exact rejection sampling)."""
