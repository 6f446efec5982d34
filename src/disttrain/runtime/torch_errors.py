"""torch's errors, told in one line: the first telling line of a multi-line message, and
the OSError behind a wrapped one."""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

# torch.distributed.checkpoint gathers every rank's failure into a CheckpointException, a
# BaseException.
FAILURES = (Exception, CheckpointException)


def first_line(err: BaseException) -> str:
    """The telling line of a (often multi-line) torch error message, shortened."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (inner, _) = min(err.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {first_line(inner)}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(("Traceback", "File "))]
    if not lines:
        return type(err).__name__
    # "Error(s) in loading state_dict for Net:" says nothing the next line does not.
    telling = next((line for line in lines if not line.endswith(":")), lines[0])
    return telling[:300]


def os_error(err: BaseException | None) -> OSError | None:
    """``err`` itself or the OSError it was raised while handling (torch wraps them: a full
    disk in ``torch.save`` is a RuntimeError "unexpected pos"; in DCP, a CheckpointException)."""
    seen = 0
    while err is not None and seen < 10:
        if isinstance(err, OSError):
            return err
        if isinstance(err, CheckpointException) and err.failures:
            _, (inner, _) = min(err.failures.items(), key=lambda item: item[0])
            err = inner
        else:
            err = err.__cause__ or err.__context__
        seen += 1
    return None
