"""Error types shared by every layer.

`ValueError`/`TypeError`/`FileNotFoundError` are used for what they mean; these add context
(the file, row and field of a bad document, the stream of a failed chunk) so that a message
read on the host says exactly what to fix.
"""

from __future__ import annotations

__all__ = ["BAD_REASONS", "BadInputError", "ConfigError", "IngestInternalError", "StreamError"]


class ConfigError(ValueError):
    """A config (or a resume against a config) is invalid; lists every violation at once."""

    def __init__(self, problems: list[str], *, where: str = "config"):
        self.problems = list(problems)
        self.where = where
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in {where}:\n{lines}")

    def __reduce__(self):
        return (_rebuild, (ConfigError, (self.problems,), {"where": self.where}))


class BadInputError(ValueError):
    """A document, file or column of the corpus cannot be used.

    Attributes:
      reason: a short machine-readable reason (``null_text``, ``empty_text``, ``corrupt_file``...),
        the same key under which a skip of this kind is counted.
      path: the file.
      row: the row within the file, or None for a whole-file problem.
    """

    def __init__(self, message: str, *, reason: str, path: str, row: int | None = None):
        self.reason = reason
        self.path = path
        self.row = row
        super().__init__(message)

    def __reduce__(self):
        return (_rebuild, (BadInputError, (str(self),),
                           {"reason": self.reason, "path": self.path, "row": self.row}))


class StreamError(RuntimeError):
    """A stream failed while producing a chunk; carries the stream id and where it was."""

    def __init__(self, message: str, *, stream_id: int, worker: str | None = None):
        self.stream_id = stream_id
        self.worker = worker
        super().__init__(message)

    def __reduce__(self):
        return (_rebuild, (StreamError, (str(self),),
                           {"stream_id": self.stream_id, "worker": self.worker}))


class IngestInternalError(AssertionError):
    """A broken invariant: this is a bug in ingest, please report it with the message."""


def _rebuild(cls, args, kwargs):
    # Exceptions cross process boundaries (Ray) by pickling; keyword-only fields need this.
    return cls(*args, **kwargs)


# Reason codes for bad documents; index 0 means "good".
BAD_REASONS = ("ok", "null_text", "empty_text", "invalid_utf8", "invalid_json",
               "invalid_token_id", "tokenizer_error", "worker_crash")
