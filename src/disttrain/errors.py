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


def one_line(err: BaseException, limit: int = 240) -> str:
    """``err`` in a message: its type and its text's first line. A longer line keeps its head and its
    tail: a client's message may be a page, and its cause is said last ("Caused by ...")."""
    lines = str(err).strip().splitlines()
    first = lines[0] if lines else "no detail"
    if len(first) > limit:
        first = f"{first[:limit // 2 - 2]} ... {first[-(limit // 2 - 3):]}"
    return f"{type(err).__name__}: {first}"
