"""``disttrain sagemaker run FILE [ARGS...]``: a SageMaker notebook or script, untouched."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    sagemaker = sub.add_parser("sagemaker", help="run a SageMaker SDK notebook or script unchanged",
                               description="SageMaker SDK code on your own machines: `import sagemaker` (SDK v2 "
                               "and v3 module paths) is served by disttrain in that process only.")
    actions = sagemaker.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = actions.add_parser("run", help="run a .py script or every code cell of a .ipynb notebook",
                             description="Run FILE (.py as python would; .ipynb cell by cell, as Jupyter's Run All) "
                             "with `import sagemaker` served by disttrain: each fit()/train() is a recorded job "
                             "(disttrain jobs ls), each tuner a tuning job (disttrain tune ls).")
    run.add_argument("file", metavar="FILE", help="a .py script or a .ipynb notebook")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script (sys.argv)")
    run.set_defaults(handler=handle_run)


def handle_run(args: argparse.Namespace) -> int:
    from ..sagemaker.notebook import run

    return run(args.file, list(args.args))
