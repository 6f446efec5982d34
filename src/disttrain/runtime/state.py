"""The runtime's mutable state, held on one object that the :class:`~.context.Context` owns.

What ``prepare()``, ``epochs()``, ``resume()`` and the checkpoints need to know about each
other lives here rather than in module globals, so that it has one lifetime -- that of the
context (``disttrain.shutdown()`` drops it) -- and so that the modules reading it need not
import each other: each imports this leaf module (through the context) instead.

What stays process-wide, on purpose: the SIGTERM flag (:mod:`.preemption`; a signal
handler has no context to reach), the hang watchdog's heartbeat file (:mod:`.heartbeat`)
and the bench's step timer (:mod:`.steptimer`), both set by the launcher's environment for
the life of the process, whatever contexts come and go.
"""

from __future__ import annotations

import weakref
from typing import Any


class Runtime:
    """Everything the runtime remembers between calls for one context.

    Weak references for what the script owns (models, loaders), so that an object the
    script drops is freed as usual.
    """

    def __init__(self) -> None:
        # each model prepare() returned -> its runtime.strategies.Strategy
        self.models: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self.loaders: weakref.WeakSet[Any] = weakref.WeakSet()
        self.training: Any = None  # the TrainingState the last resume() returned
        self.owns_group = False  # only a group init() created is destroyed by shutdown()
        self.pending_save: Any = None  # an asynchronous checkpoint still being written
        self.async_group: Any = None  # the CPU group asynchronous checkpoints talk over
        self.staging: Any = None  # how checkpoints are staged here (checkpoint_stage.Staging), chosen once
        self.host_buffers: Any = None  # the host buffers CUDA state is staged in, kept between saves
        self.pg_timeout_s = 300.0  # the process group's timeout: how long a collective may wait

    def prepared(self, model: Any) -> Any:
        """The strategy ``model`` (as prepare() returned it) was prepared with, or None."""
        try:
            return self.models.get(model)
        except TypeError:  # not weak-referenceable: not a module prepare() returned
            return None
