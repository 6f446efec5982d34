"""Steady-state training throughput, measured where the batches are handed out.

``disttrain bench`` runs a script under several process counts and needs the same number
from each: samples per second once the first steps (allocations, thread pools, gloo's
first buckets) are over. The script need not change for it: the bench exports

- ``DISTTRAIN_BENCH_STEPS=N``  -- time N training steps, then report (and stop the run);
- ``DISTTRAIN_BENCH_WARMUP=W`` -- after W untimed steps (default 5);
- ``DISTTRAIN_BENCH_EXIT=0``   -- report but let the script run to its end (default: stop);

and the training loader's batches go through :func:`timed`. A prepared loader does that
itself (``PreparedLoader.__iter__`` calls :func:`timed` for loaders with a
``DistributedSampler``, i.e. training data); a script with its own loader can wrap it:
``for x, y in disttrain.runtime.steptimer.timed(train_dl):``. Without the variables
:func:`timed` returns its argument untouched, so it costs nothing outside a bench.

A step is the time from asking for a batch to asking for the next one: data loading,
forward, backward and the optimizer step. Time spent outside the loop (evaluation between
epochs) is not counted. Throughput is every rank's samples over the slowest rank's time,
so all ranks must time the same number of steps -- true of a ``DistributedSampler``,
which pads the ranks' shares to equal length. Rank 0 prints the result as one line on
stdout, :data:`MARKER` followed by JSON, which reaches the launcher's terminal from any
host; then every rank exits with code 0 at the same step.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..errors import UsageError
from ..workerenv import BENCH_EXIT, BENCH_STEPS, BENCH_WARMUP, WorkerEnv
from ..workerenv import BENCH_MARKER as MARKER
from . import comm

T = TypeVar("T")

DEFAULT_WARMUP = 5

__all__ = ["BENCH_EXIT", "BENCH_STEPS", "BENCH_WARMUP", "MARKER", "BenchSettings", "StepTimer",
           "active", "timed"]


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """What the bench asked for; None from :meth:`from_environ` when no bench is running."""

    steps: int
    warmup: int = DEFAULT_WARMUP
    exit_when_done: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UsageError(f"{BENCH_STEPS}={self.steps}: time at least 1 step")
        if self.warmup < 0:
            raise UsageError(f"{BENCH_WARMUP}={self.warmup}: warm-up steps cannot be negative")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> BenchSettings | None:
        environ = os.environ if environ is None else environ
        steps = environ.get(BENCH_STEPS)
        if not steps:
            return None
        return cls(
            steps=_int(BENCH_STEPS, steps),
            warmup=_int(BENCH_WARMUP, environ.get(BENCH_WARMUP) or str(DEFAULT_WARMUP)),
            exit_when_done=environ.get(BENCH_EXIT, "1") != "0",
        )


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}={raw!r} is not an integer") from None


class StepTimer:
    """Counts steps, times ``settings.steps`` of them after ``settings.warmup``, reports.

    ``clock`` and ``report`` are parameters so that tests can drive it without sleeping;
    the defaults are ``time.perf_counter`` and printing on rank 0.
    """

    def __init__(self, settings: BenchSettings, *, clock: Callable[[], float] = time.perf_counter,
                 report: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.report = report or _print_on_main
        self.steps_run = 0  # steps finished, warm-up included
        self.reported = False
        self._samples = 0  # this rank's samples in the timed steps
        self._window_start: float | None = None
        self._paused_since: float | None = None
        self._paused = 0.0  # time outside the loop (between epochs) inside the window
        self._opening = False
        self._step_start: float | None = None
        self.step_ms: list[float] = []  # each timed step of this rank, in ms
        self.blocked_ms: list[float] = []  # of which spent in a periodic synchronisation
        self.synced: list[bool] = []  # whether each timed step all-reduced (bench --comm's reference)
        self.waited = comm.sync_waited  # seconds a synchronisation took since last asked (tests replace it)
        self.took_sync = comm.take_synced

    def wrap(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, with the time between consecutive requests counted as steps."""
        if self._paused_since is not None:
            paused = self.clock() - self._paused_since
            self._paused += paused
            if self._step_start is not None:
                self._step_start += paused
            self._paused_since = None
        if self.settings.warmup == 0 and self._window_start is None:
            self._window_start = self._step_start = self._synced_clock()
        self._opening = True  # a loader that times itself inside this one is not timed twice
        try:
            iterator = iter(batches)
        finally:
            self._opening = False
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                if self._window_start is not None:
                    self._paused_since = self.clock()
                return
            yield batch
            # The script asks for the next batch: the step that used this one is over.
            self._step_done(_batch_len(batch))

    def _step_done(self, batch_len: int) -> None:
        self.steps_run += 1
        blocked, synced = self.waited(), self.took_sync()
        warmup, steps = self.settings.warmup, self.settings.steps
        if self.steps_run == warmup:
            self._window_start = self._step_start = self._synced_clock()
        elif self.steps_run > warmup:
            self._samples += batch_len
            if self._step_start is not None and not self.reported:
                now = self.clock()
                self.step_ms.append(round((now - self._step_start) * 1e3, 2))
                self.blocked_ms.append(round(blocked * 1e3, 2))
                self.synced.append(synced)
                self._step_start = now
            if self.steps_run == warmup + steps and not self.reported:
                self._finish()

    def _synced_clock(self) -> float:
        from .context import context

        device = context().device
        if device.type == "cuda":  # kernels are asynchronous: time them, not their launch
            torch.cuda.synchronize(device)
        return self.clock()

    def _finish(self) -> None:
        from .context import context
        from .metrics import reduce_max, reduce_sum

        assert self._window_start is not None
        seconds = self._synced_clock() - self._window_start - self._paused
        # All ranks get here at the same step, so these collectives match up.
        slowest = float(reduce_max(float(seconds)))
        samples = int(reduce_sum(self._samples))
        split = self._paired_split(reduce_max) if WorkerEnv.from_environ().bench_no_sync else None
        self.reported = True
        ctx = context()
        result = self._result(samples=samples, seconds=slowest, steps=self.settings.steps,
                              world_size=ctx.world_size, complete=True)
        if split:
            # The reference's rate is its steps without communication; the split comes with it.
            result.update(paired=split, samples_per_s=samples / self.settings.steps / split["compute_ms"] * 1e3)
        self.report(result)
        if self.settings.exit_when_done:
            raise SystemExit(0)

    def _paired_split(self, slowest: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any] | None:
        """bench --comm's reference: each step without communication beside the synced step after
        it, the two timed a moment apart under the same load (runs minutes apart are not: a busy
        machine once read 40 % of an arithmetic-bound step as communication). Compute: the slowest
        rank's median no-sync step (ranks that never wait for each other, as in a run without sync).
        Communication: the median of what each pair takes beyond twice that step's slowest rank.
        ``slowest``: the elementwise max over ranks (a collective)."""
        alone, pairs = [], []
        for i in range(len(self.synced) - 1):
            if not self.synced[i] and self.synced[i + 1]:
                alone.append(self.step_ms[i])
                pairs.append(self.step_ms[i] + self.step_ms[i + 1])
        if not alone:
            return None
        own = torch.tensor(alone, dtype=torch.float64)
        compute_ms = slowest(own.quantile(0.5).reshape(1))
        comm_ms = (slowest(torch.tensor(pairs, dtype=torch.float64)) - 2 * slowest(own)).clamp(min=0)
        return {"pairs": len(alone), "compute_ms": round(float(compute_ms), 3),
                "comm_ms": round(float(comm_ms.quantile(0.5)), 3)}

    def partial(self) -> dict[str, Any] | None:
        """What this rank measured when the run ended before the timed steps did (no
        collectives: the other ranks may be gone); None once reported."""
        if self.reported:
            return None
        from .context import current_rank

        if current_rank() != 0:
            return None
        timed_steps = max(0, self.steps_run - self.settings.warmup)
        if self._window_start is None or timed_steps == 0:
            return self._result(samples=0, seconds=None, steps=0, world_size=None, complete=False)
        end = self._paused_since if self._paused_since is not None else self.clock()
        seconds = end - self._window_start - self._paused
        world = WorkerEnv.from_environ().world_size
        # Only this rank's samples are known; the others trained as many.
        return self._result(samples=self._samples * world, seconds=seconds, steps=timed_steps,
                            world_size=world, complete=False)

    def _result(self, *, samples: int, seconds: float | None, steps: int,
                world_size: int | None, complete: bool) -> dict[str, Any]:
        from ..placement import usable_cpus

        rate = samples / seconds if seconds and samples else None
        return {
            "samples_per_s": rate,
            "steps": steps,
            "warmup": self.settings.warmup,
            "steps_run": self.steps_run,
            "samples": samples,
            "seconds": seconds,
            "world_size": world_size,
            "local_world_size": WorkerEnv.from_environ().local_world_size,
            "threads": torch.get_num_threads(),
            "cpus": usable_cpus(),
            "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "complete": complete,
            "gradient_bytes": comm.gradient_bytes_seen(),
            "comm_state_bytes": comm.state_bytes(),
            # rank 0's timeline: each timed step, and what of it waited on a periodic sync
            "step_ms": self.step_ms[:steps],
            "sync_blocked_ms": self.blocked_ms[:steps],
        }


def _batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (1 if it has none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            if isinstance(item, (torch.Tensor, Mapping, list, tuple)):
                return _batch_len(item)
    return 1


def _print_on_main(result: dict[str, Any]) -> None:
    from .context import current_rank

    if current_rank() == 0:
        print(f"{MARKER} {json.dumps(result)}", flush=True)


_timer: StepTimer | None = None
_checked = False


def active() -> StepTimer | None:
    """The bench's timer for this process, made on first use; None outside a bench."""
    global _timer, _checked
    if not _checked:
        _checked = True
        settings = BenchSettings.from_environ()
        if settings is not None:
            _timer = StepTimer(settings)
            atexit.register(_report_partial)
    return _timer


def timed(batches: Iterable[T], loader: Any = None) -> Iterable[T]:
    """``batches`` timed as training steps when a bench is running, else ``batches`` itself.

    ``loader`` is the loader the batches come from, when ``batches`` is its iterator (as
    in ``PreparedLoader.__iter__``): only a loader with a ``DistributedSampler`` -- training
    data, as :func:`disttrain.prepare` shards it -- is timed, so evaluation is not.
    """
    timer = active()
    if timer is None or timer._opening or timer.reported:
        return batches
    if loader is not None:
        from torch.utils.data import DistributedSampler

        if not isinstance(getattr(loader, "sampler", None), DistributedSampler):
            return batches
    return timer.wrap(batches)


def _report_partial() -> None:
    timer = _timer
    if timer is None:
        return
    result = timer.partial()
    if result is not None:
        try:
            print(f"{MARKER} {json.dumps(result)}", file=sys.stdout, flush=True)
        except (OSError, ValueError):  # stdout already closed at exit: nothing to tell
            pass


def _reset() -> None:
    """Forget the timer (tests)."""
    global _timer, _checked
    _timer, _checked = None, False
