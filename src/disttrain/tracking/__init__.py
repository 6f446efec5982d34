"""Runs and jobs in the trackers the field already runs: MLflow, Trackio, W&B (``--track``).

One writer per run, in the launcher's process (:class:`~.follower.RunTracker`): it reads the
workers' track lines from the output every launcher relays (:mod:`disttrain.trackline`), the
membership record, the hang verdict and the exit, and sends them through one :class:`~.sink.Sink`.
So the workers never import a tracker client (no start-up cost per rank, no network from every
host -- only the launcher must reach the tracking server), nothing elects a writer rank, and a
run is one tracker run whatever its world size; per-rank series come as ``rank<N>/<name>``
when asked (``--track-ranks``). Each tracker is configured its own way (``MLFLOW_TRACKING_URI``,
``MLFLOW_EXPERIMENT_NAME``, ``WANDB_MODE``, ``WANDB_PROJECT``, ``TRACKIO_DIR``, ...).
"""

from __future__ import annotations

from .sink import TRACKERS, Sink, check_tracker, open_sink, script_params, sink_class

__all__ = ["TRACKERS", "Sink", "check_tracker", "open_sink", "script_params", "sink_class"]
