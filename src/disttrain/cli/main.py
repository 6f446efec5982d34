"""``disttrain`` entry point: dispatch to one module per subcommand, map errors to exit codes."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

from .. import bounds
from ..errors import DisttrainError, UsageError, error_line
from ..version import __version__
from . import agent as agent_cmd
from . import bench as bench_cmd
from . import doctor as doctor_cmd
from . import job as job_cmd
from . import jobs as jobs_cmd
from . import quick_exit
from . import run as run_cmd
from . import sagemaker as sagemaker_cmd
from . import tune as tune_cmd
from . import ui as ui_cmd

SUBCOMMANDS = (run_cmd, doctor_cmd, agent_cmd, bench_cmd, job_cmd, jobs_cmd, sagemaker_cmd, tune_cmd, ui_cmd)
# What launchers run on the hosts; never offered to a user in help or errors.
HIDDEN = frozenset({"agent", "receive", "batch-step", "run-spec", "launch-step"})  # launch-step: batch-step's old name
_INVALID_CHOICE = re.compile(r"argument \S+: invalid choice: '(.*)' \(choose from")


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus an error; a user needs one line saying what to fix."""

    def error(self, message: str):  # type: ignore[override]
        m = _INVALID_CHOICE.match(message)
        if m:
            message = self._unknown_command(m.group(1))
        # main() already says "disttrain: error:"; name the subcommand only.
        where = self.prog.removeprefix("disttrain").strip()
        raise UsageError(f"{where + ': ' if where else ''}{message} (see {self.prog} --help)")

    def _unknown_command(self, word: str) -> str:
        public = [name for name in self._command_names() if name not in HIDDEN and not name.startswith("_")]
        text = f"unknown command {word!r} (choose from {', '.join(public)})"
        if word.endswith(".py") or os.path.isfile(word):
            text += f"; to run a script: disttrain run {word}"
        return text

    def _command_names(self) -> list[str]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return list(action.choices)
        return []


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="disttrain",
        description="Run a PyTorch training script as a data-parallel job.",
    )
    parser.add_argument("--version", action="version", version=f"disttrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    for command in sub.choices.values():
        command.root = parser  # --print-completion completes every command, from the root
    return parser


def check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every number the command line gave, against its range (:mod:`disttrain.bounds`): at parse
    time, one line naming the flag and the range -- for every subcommand, with no list to keep."""
    for chosen in _chosen(parser, getattr(args, "handler", None)) or [parser]:
        for action in chosen._actions:
            if action.option_strings and action.dest != "help":
                value = getattr(args, action.dest, None)
                flag = next((f for f in action.option_strings if f.startswith("--") and "_" not in f),
                            action.option_strings[-1])
                for item in value if isinstance(value, list) else [value]:
                    bounds.option(flag, action.dest, item)


def _chosen(parser: argparse.ArgumentParser, handler) -> list[argparse.ArgumentParser]:
    """The parsers from ``parser`` down to the subcommand whose handler runs (found by it: a
    subcommand's own positional may be called ``command`` too, as ``bench``'s is)."""
    if handler is not None and parser._defaults.get("handler") is handler:
        return [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                below = _chosen(sub, handler)
                if below:
                    return [parser, *below]
    return []


# Commands whose process ends at once when they return (quick_exit.py): a launcher's job is over. By
# handler: ``args.command`` is the subcommand's name only where the subcommand has no ``command`` of
# its own (``disttrain bench``'s is the script to time).
QUICK_EXIT = (run_cmd.handle,)


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        check_numbers(parser, args)
        code = args.handler(args)  # a node's agent never returns: it ends its own process (agent/entry.py)
        if argv is None and args.handler in QUICK_EXIT:  # the process's own command line, not a caller's list
            code = quick_exit.exit_now(code)
    except DisttrainError as err:
        print(error_line(err), file=sys.stderr)
        code = err.exit_code
    except KeyboardInterrupt:
        print("disttrain: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:
        # The reader left (`disttrain jobs show 3 | head`): stop quietly with a SIGPIPE status, as
        # `cat` would; stdout goes to /dev/null so that the exit's own flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 128 + signal.SIGPIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
