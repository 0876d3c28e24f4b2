"""Hooks that let a test hold a worker's progress by construction, and slow or speed every model
forward to prove that no test depends on how fast the machine is. Both are off unless their
environment variable is set (worker processes inherit it from whoever started Ray), and cost one
dictionary lookup when off.

- ``SVIP_TEST_GATE_DIR=DIR``: a target worker verifies a batch only while the file ``DIR/target``
  is absent, or holds a number larger than the batches verified since it was last written ("0":
  none pass; "1": one more, e.g. a prompt's prefill; writing it again grants a fresh count). The
  worker stays responsive meanwhile (Stats, cancels, new sessions): a held step is skipped, never
  slept in. Write the file with ``hold(dir, name, steps)`` (atomic), delete it with
  ``release(dir, name)``; once the worker has used up the steps and holds one back it writes the
  grant it used up to ``DIR/name.holding``, which ``holding`` compares with the current grant.
- ``SVIP_TEST_FORWARD_DELAY_S=S``: every KV-pool forward sleeps S seconds first (a slow machine).

A production worker has neither. A worker announces them when it starts (``announce``): one set
is logged at CRITICAL and reported in its Stats (``WorkerStats.test_hooks``), and a delay that is
not a number fails the start, not every forward (it is parsed once; a forward still looks the
variable up, one dictionary lookup). The Helm chart's schema refuses their names (review N5).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

GATE_DIR_VAR = "SVIP_TEST_GATE_DIR"
FORWARD_DELAY_VAR = "SVIP_TEST_FORWARD_DELAY_S"
HOOKS = (GATE_DIR_VAR, FORWARD_DELAY_VAR)
log = logging.getLogger(__name__)


def active(environ=os.environ) -> list[str]:
    """The hooks set in this environment, as NAME=value (none in production)."""
    return [f"{name}={environ[name]}" for name in HOOKS if environ.get(name)]


def announce(role: str, environ=os.environ) -> list[str]:
    """At a worker's start: every hook set, logged at CRITICAL (a worker held or slowed by one stays
    healthy otherwise), and the forward delay checked once. Returns them, for its Stats."""
    hooks = active(environ)
    for hook in hooks:
        log.critical("the %s worker runs with the test hook %s: it holds or slows this worker; never set it in "
                     "production", role, hook)
    _delay_s(environ.get(FORWARD_DELAY_VAR) or "")
    return hooks


class StepGate:
    """Whether the next step of a worker may run (always, unless a test holds it)."""

    def __init__(self, name: str, environ=os.environ):
        root = environ.get(GATE_DIR_VAR)
        self.path = Path(root) / name if root else None
        self.passed = 0  # steps let through since the gate file was last written
        self.grant = ""  # the file's text then: a new text is a new grant
        self.told = False  # whether .holding says this grant is used up

    def idle_allowed(self) -> bool:
        """Whether optional work (a prefill while idle) may run: only while no test holds or
        counts this worker's steps (such work would change what the test counts)."""
        return self.path is None or not self.path.exists()

    def open(self) -> bool:
        if self.path is None:
            return True
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            self.passed, self.grant = 0, ""
            return True
        if text != self.grant:
            self.passed, self.grant, self.told = 0, text, False
        field = text.split()[0] if text.split() else ""
        allowed = int(field) if field.isdigit() else 0
        if self.passed < allowed:
            self.passed += 1
            return True
        if not self.told:  # holding back, under this grant
            self.path.with_suffix(".holding").write_text(text)
            self.told = True
        return False


def hold(root: str | Path, name: str, steps: int = 0) -> None:
    """Close the gate `name` after `steps` more steps from now (atomically: the worker never reads
    half a file); each call is a fresh grant, also while the gate is closed."""
    path = Path(root) / name
    path.with_suffix(".holding").unlink(missing_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{steps} {time.monotonic_ns()}")
    os.replace(tmp, path)


def release(root: str | Path, name: str) -> None:
    (Path(root) / name).unlink(missing_ok=True)
    (Path(root) / name).with_suffix(".holding").unlink(missing_ok=True)


def holding(root: str | Path, name: str) -> bool:
    """Whether the worker has used up the steps of the latest grant and now holds the next one."""
    path = Path(root) / name
    try:
        return path.with_suffix(".holding").read_text() == path.read_text()
    except FileNotFoundError:
        return False


def forward_delay(environ=os.environ) -> None:
    """Sleep as long as the test environment asks before a forward (not at all by default)."""
    delay = _delay_s(environ.get(FORWARD_DELAY_VAR) or "")
    if delay:
        time.sleep(delay)


@functools.lru_cache(maxsize=4)
def _delay_s(text: str) -> float:
    """The forward delay a value asks for, parsed once per value (a bad one: a one-line error)."""
    if not text:
        return 0.0
    try:
        delay = float(text)
    except ValueError:
        raise ValueError(f"{FORWARD_DELAY_VAR}={text!r} is not a number of seconds") from None
    if not 0 <= delay < 60:
        raise ValueError(f"{FORWARD_DELAY_VAR}={text!r}: a delay in [0, 60) seconds")
    return delay
