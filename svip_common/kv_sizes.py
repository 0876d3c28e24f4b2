"""A KV pool's sizes: tokens per page, the default pool, and a capacity in whole pages. No torch:
the CLI and the Serve app's settings read these without loading the model stack
(svip_common/kv_cache.py is the pool itself)."""

from __future__ import annotations

PAGE_SIZE = 16  # tokens per page
DEFAULT_KV_TOKENS = 32768  # a pool's size in tokens when none is given


def whole_pages(tokens: int, page_size: int = PAGE_SIZE) -> int:
    """The room ``tokens`` take in a pool, in tokens: a sequence holds whole pages."""
    return -(-tokens // page_size) * page_size
