"""The draft side: length policies and the drafter that proposes variable-length blocks."""
