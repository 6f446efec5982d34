"""Exceptions that the CLI turns into one line and an exit code, never a traceback."""

from __future__ import annotations


class DisttrainError(Exception):
    """A failure the user can act on; ``str(err)`` is the whole message."""

    exit_code = 1


class UsageError(DisttrainError):
    """Bad input (flags, paths, config): reported before anything is started."""

    exit_code = 2


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``): a file or script name the
    user gave may hold a newline or a terminal escape, and a usage error stays one line."""
    return "".join(ch if ch.isprintable() or (keep_newlines and ch == "\n") else ascii(ch)[1:-1] for ch in text)


def error_line(err: DisttrainError) -> str:
    """How an error is said to the user: one line for bad input, the whole report otherwise."""
    return f"disttrain: error: {printable(str(err), keep_newlines=not isinstance(err, UsageError))}"
