"""What the target worker checks of a draft worker's messages before they change anything: the
wire is not trusted. Each failure is a WorkerError, which gives the draft up for that session
(the target goes on alone), never the caller's error. Pure functions of the message and the
session's numbers, so they are tested without models (tests/unit/test_wire_checks.py)."""

from __future__ import annotations

import math

from svip_common.contracts import Block, GenerationRequest, Limits, check_token_ids
from svip_common.errors import InvalidRequest, WorkerError
from svip_common.messages import DraftedBlock
from svip_common.trees import check_grown, check_siblings
from svip_common.trees import grows as tree_grows

PREPARED_REACH_BLOCKS = 3  # a prepared block's parent lies within this many blocks of the committed tokens
MAX_PREPARED = 64  # prepared blocks a session keeps at once (a draft prepares 8 per outstanding block, and 8 more)
MAX_TIMING_S = 1e12  # a draft clock's reading (time.time(): about 1.8e9 now) or a duration: 31,700 years is no clock


def check_timings(block: DraftedBlock) -> None:
    """Its timings go into stats and the cost model (auto's price of a drafted token is a fit of
    them): finite, not negative and within MAX_TIMING_S, so no product in a fit overflows."""
    for name in ("started_at", "finished_at", "draft_s", "trigger_at"):
        value = getattr(block, name)
        if not math.isfinite(value) or not 0 <= value <= MAX_TIMING_S:
            raise WorkerError(f"draft worker sent a block whose {name} is {value!r}")


def check_prepared(base: int, committed: int, kept: int, limits: Limits) -> None:
    """A prepared continuation's parent within the outstanding blocks' reach, and room to keep it."""
    reach = committed + PREPARED_REACH_BLOCKS * (limits.max_draft_length + 1)
    if base > reach or kept >= MAX_PREPARED:
        raise WorkerError(
            f"draft worker sent a prepared block at base {base}, beyond the outstanding "
            f"blocks' reach ({reach}) or past {MAX_PREPARED} kept"
        )


def check_block(drafted: DraftedBlock, committed: int, request: GenerationRequest, limits: Limits) -> Block:
    """A block to verify: on the committed sequence, and as ``check_held`` says."""
    if drafted.base != committed:
        raise WorkerError(f"draft worker sent a block at base {drafted.base}, committed {committed}")
    return check_held(drafted, request, limits)


def check_held(drafted: DraftedBlock, request: GenerationRequest, limits: Limits) -> Block:
    """A block as it arrives to be held (a follow-up, whose tokens its predecessor's forward may
    feed: target_worker/lookahead.py) or verified: ids in range, within the cap and within the
    session's budget (hence the context); a sampled one with q(d) for every token. (Its shape, a q
    and an entropy per token or none, the service's edge checked when it read it.)"""
    checked = drafted.block
    try:
        check_token_ids(checked.tokens, limits.tokens, "drafted token id")
    except InvalidRequest as exc:
        raise WorkerError(f"draft worker sent a bad block: {exc}") from None
    if len(checked) > limits.max_draft_length:
        raise WorkerError(f"draft worker sent a block of {len(checked)} tokens; the cap is {limits.max_draft_length}")
    limit = len(request.prompt_ids) + request.max_new_tokens
    if checked.base + len(checked) + 1 > limit:
        raise WorkerError(
            f"draft worker sent a block of {len(checked)} tokens at base {checked.base}, past the "
            f"session's {limit} tokens (prompt + max_new_tokens)"
        )
    if not request.sampling.greedy and len(checked.probs) != len(checked):
        raise WorkerError("draft worker sent a sampled block without q(d) for every token")
    if checked.siblings is not None:
        _check_tree(checked, request, limits)
    elif checked.q_rows is not None:
        raise WorkerError("draft worker sent q rows with a chain (a rejection's correction is drawn on its side)")
    return checked


def check_growth(more: DraftedBlock, request: GenerationRequest, limits: Limits) -> None:
    """More tokens of a greedy chain's or flat tree's follow-up or prepared continuation (growth.py,
    stepping.py's ``_sent_now``): ids in range, within the cap, a q for each where the draft sends
    them, a tree's siblings well formed, nothing sampled, nothing of a deep tree's session (its grown
    nodes follow the spine in the layout: a longer spine would move them). The tree's nodes with
    what is held: AheadBlocks.grow."""
    block = more.block
    if not request.sampling.greedy or tree_grows(request.policy.tree):
        raise WorkerError("draft worker grew a block other than a greedy chain or flat tree")
    try:
        check_token_ids(block.tokens, limits.tokens, "drafted token id")
    except InvalidRequest as exc:
        raise WorkerError(f"draft worker sent a bad block: {exc}") from None
    if not block.tokens or more.grows + len(block) > limits.max_draft_length:
        raise WorkerError(f"draft worker grew a block of {more.grows} tokens by {len(block)}; the cap is "
                          f"{limits.max_draft_length}")
    limit = len(request.prompt_ids) + request.max_new_tokens
    if more.base + more.grows + len(block) + 1 > limit:
        raise WorkerError(f"draft worker grew a block at base {more.base} to {more.grows + len(block)} tokens, "
                          f"past the session's {limit} tokens (prompt + max_new_tokens)")
    if block.probs and len(block.probs) != len(block):
        raise WorkerError("draft worker grew a block with q(d) for some of its tokens")
    if block.siblings is not None:
        _check_tree(block, request, limits)


def _check_tree(block: Block, request: GenerationRequest, limits: Limits) -> None:
    """A tree only where the session asked for one; its siblings well formed; a sampled one's q
    rows (their shape checked as they were read), which its multi-candidate rejection reads, and
    a greedy one's none."""
    if request.policy.tree == "off":
        raise WorkerError("draft worker sent a token tree for a session that drafts chains")
    if block.is_tree and (block.q_rows is None) != request.sampling.greedy:
        raise WorkerError("draft worker sent a sampled tree without its q rows" if block.q_rows is None
                          else "draft worker sent q rows with a greedy tree")
    if block.grown and not tree_grows(request.policy.tree):
        raise WorkerError("draft worker sent grown nodes for a session whose trees do not grow")
    problem = check_siblings(block.tokens, block.siblings) or check_grown(len(block), block.siblings, block.grown or ())
    if problem is None:
        try:
            check_token_ids([t for options in block.siblings for t in options], limits.tokens, "sibling token id")
            check_token_ids([t for _, t in block.grown or ()], limits.tokens, "grown token id")
        except InvalidRequest as exc:
            problem = str(exc)
    if problem is not None:
        raise WorkerError(f"draft worker sent a bad tree: {problem}")


def check_correction(token: int, due: bool, limits: Limits) -> int:
    """A correction the draft drew from the target's p row: only when a sampled rejection's
    feedback asked for one (due), and an id in range (greedy tokens are the target's own)."""
    if not due:
        raise WorkerError("draft worker sent a correction no feedback asked for")
    try:
        check_token_ids([token], limits.tokens, "correction token id")
    except InvalidRequest as exc:
        raise WorkerError(f"draft worker sent a bad block: {exc}") from None
    return token
