"""Starts whose grammar is not compiled yet wait for it off the compute thread (review H-2).

A grammar's matcher takes a while to build (0.6-0.8 s for a 62 KB schema of URI fields at a
4,096-id vocabulary, more at a large one), and the compute thread runs every session of the
worker: built there, one request's starts stopped every neighbour for seconds. So a start whose
grammar the worker has not compiled waits, "compiling": the build runs on the compute loop's aside
thread (svip_runtime/compute_loop.py), the steps go on, and the start is handled once the matcher
is ready (held in grammar_mask.COMPILED until then, so no other compile pushes it out). Starts of
one grammar (a request's n choices) wait for one build; whatever else arrives for a waiting session
(its cancel) waits behind its start, in order. Runs on the compute thread."""

from __future__ import annotations

from collections.abc import Callable

from svip_common.errors import Overloaded
from svip_common.grammar_mask import COMPILED, CompiledGrammars

MAX_WAITING_SESSIONS = 256  # starts waiting for a grammar on one worker; past it a start is refused


class GrammarWaits:
    def __init__(self, compute, grammars: CompiledGrammars = COMPILED):
        self._compute = compute
        self._grammars = grammars
        self._waiting: dict[str, list[Callable[[], None]]] = {}  # session id -> what waits, in order
        self._compiling: dict[tuple, list[str]] = {}  # (grammar, tokenizer) -> the sessions waiting for it

    def __len__(self) -> int:
        return len(self._waiting)

    def waits(self, session_id: str, needs: tuple | None, resume: Callable[[], None]) -> bool:
        """Whether a request of session_id waits: resume() runs once its session's grammar is
        compiled. needs: the (grammar, tokenizer) the request's start compiles (None: none)."""
        if session_id in self._waiting:
            self._waiting[session_id].append(resume)
            return True
        if needs is None or self._grammars.ready(*needs):
            return False
        if len(self._waiting) >= MAX_WAITING_SESSIONS:
            raise Overloaded(f"{len(self._waiting)} sessions wait for their grammars to compile on this worker; "
                             "retry later")
        self._waiting[session_id] = [resume]
        if needs in self._compiling:
            self._compiling[needs].append(session_id)
        else:
            self._compiling[needs] = [session_id]
            self._compute.aside(lambda: self._grammars.hold(*needs), lambda _: self._compiled(needs))
        return True

    def _compiled(self, needs: tuple) -> None:
        try:
            for session_id in self._compiling.pop(needs):
                for resume in self._waiting.pop(session_id, ()):
                    resume()
        finally:
            self._grammars.release(*needs)
