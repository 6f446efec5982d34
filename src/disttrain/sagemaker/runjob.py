"""``python -m disttrain.sagemaker.runjob SPEC.json JOB_NAME``: one ``fit``, in its own process.

The notebook's process checked the spec already (trainingjob.check_job); this process runs it to the end (recording every
step) and exits with the job's exit code. It deletes the spec file it was given.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from ..errors import DisttrainError
    from ..jobs.runner import run_job
    from ..jobs.spec import spec_from_mapping
    from ..wire import FitRequest

    spec_file, name = (sys.argv[1:] if argv is None else argv)[:2]
    try:
        with open(spec_file) as fh:
            line = fh.read()
    finally:
        os.unlink(spec_file)
    try:
        spec = spec_from_mapping(FitRequest.from_line(line).spec, base_dir="/", source="estimator")
        record = run_job(spec, job_name=name, checked=True)  # checked by the notebook's process
    except DisttrainError as err:
        print(f"disttrain: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    return record.exit_code if record.exit_code is not None else 1


if __name__ == "__main__":
    sys.exit(main())
