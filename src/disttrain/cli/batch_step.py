"""Inside a batch allocation, the client's event sink rebuilt from what it shipped
(``Events.batch_step_client``).

The batch launcher cannot carry a Python object into the allocation; each client names
itself in the batch step and is rebuilt here, at the top of the layers, where every client
is importable (the launch package imports none of them).
"""

from __future__ import annotations

from ..jobs.runner import JobBatchStepEvents
from ..launch import Events
from ..plan.launch import ContainerPlanner
from ..wire import JobClient, RunClient
from .run import RunEvents


def client_for_batch_step(client: RunClient | JobClient | None) -> tuple[Events, ContainerPlanner | None]:
    """The client's event sink, and what it adds to the plan (a job's container; the launch
    context's ``container``)."""
    if isinstance(client, JobClient):
        events = JobBatchStepEvents.from_batch_step(client)
        return events, events.planner
    return RunEvents(), None
