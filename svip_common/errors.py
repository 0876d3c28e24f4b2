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
