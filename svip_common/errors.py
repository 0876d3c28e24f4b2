"""Errors that carry a message meant for the user: the CLI prints them on one line, the servers
turn them into HTTP 400 / gRPC INVALID_ARGUMENT."""


class SvipError(Exception):
    """Base class: anything the caller did or named wrong, explained in one line."""


class InvalidRequest(SvipError, ValueError):
    """A request parameter or prompt that cannot be served."""


class ModelLoadError(SvipError):
    """A model or tokenizer that cannot be loaded, or a draft that does not fit the target."""


class WorkerUnavailable(SvipError):
    """A worker is down or unreachable."""


class Overloaded(SvipError):
    """A worker cannot take this session now (its session caps or KV room): the session alone is
    refused (gRPC RESOURCE_EXHAUSTED), every other goes on."""


# (a tensor-parallel rank lost mid-step leaves the group's ranks apart: the whole group starts again)
_DEVICE_FAILURES = ("CUDA error", "AcceleratorError", "device-side assert", "CUBLAS_STATUS", "cuDNN error",
                    "RankLost")


class RankLost(SvipError):
    """A tensor-parallel rank stopped answering its group (svip_common/tensor_parallel.py)."""


def exit_on_device_failure(exc: BaseException) -> None:
    """A CUDA error is sticky (a device-side assert fails every later kernel of the process): the
    worker exits at once, so Ray restarts it on a fresh context and its sessions recover
    (coordinator/session/draft_port.py, coordinator/distributed.py). Any other error is left to the caller."""
    text = f"{type(exc).__name__}: {exc}"
    if any(mark in text for mark in _DEVICE_FAILURES):
        import logging
        import os

        logging.getLogger(__name__).critical("device failure, exiting so the worker is replaced: %s", text)
        os._exit(70)


def narrowed(run, items: list, retry=lambda items: None, passing: tuple = ()) -> list:
    """``run(items)``: one result per item. When it raises (an exception of ``passing`` aside,
    and a device failure, which exits), the items are run again in halves (``retry(items)``
    first: undo what the failed run left), down to the single items that fail on their own, whose
    result is their exception: one item's failure fails that item, not its batch (one bad item
    among n costs about 2·log2 n more runs, once)."""
    try:
        return run(items)
    except passing:
        raise
    except Exception as exc:
        exit_on_device_failure(exc)
        retry(items)
        if len(items) == 1:
            return [exc]
        half = len(items) // 2
        return narrowed(run, items[:half], retry, passing) + narrowed(run, items[half:], retry, passing)


class WorkerError(SvipError):
    """A worker failed while serving the session."""
