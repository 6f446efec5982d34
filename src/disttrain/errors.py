"""Exceptions that the CLI turns into one line and an exit code, never a traceback."""

from __future__ import annotations


class DisttrainError(Exception):
    """A failure the user can act on; ``str(err)`` is the whole message."""

    exit_code = 1


class UsageError(DisttrainError):
    """Bad input (flags, paths, config): reported before anything is started."""

    exit_code = 2
