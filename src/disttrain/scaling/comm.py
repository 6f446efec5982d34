"""Is the network the limit? A step split into compute and communication, and whether
gradient compression is worth turning on.

``disttrain bench --comm`` times each process count three ways through the same step timer:
as asked, with DDP exchanging no gradients at all (torch's no-op communication hook: the
same steps, the same CPU contention, no wire), and with each compression. From them:

- compute time per step = the no-sync step; communication = the sync step minus it (what
  the all-reduce adds after overlapping with the backward pass);
- the bus bandwidth that communication time implies for the gradient size, against
  the ring all-reduce's bound 2(N-1)/N * S / B when the link rate B is given;
- a recommendation: the fastest compression if it beats plain DDP by more than
  :data:`WORTH`, else none (a compute-bound job gains nothing and pays accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass

# A compression must beat plain all-reduce by this factor to be recommended: below it the
# gain is within the noise of a shared machine and not worth the rounding of the gradients.
WORTH = 1.05
# Communication at or above this share of a step makes the job communication-bound.
COMM_BOUND = 0.2


@dataclass(frozen=True)
class Choice:
    name: str  # "none" or a compression
    speedup: float  # its samples/s over plain DDP's
    reason: str


def recommend_compression(plain: float, compressed: dict[str, float]) -> Choice:
    """The compression to use given samples/s measured with plain DDP and with each one."""
    if not compressed:
        return Choice("none", 1.0, "no compression was measured")
    best = max(compressed, key=lambda name: compressed[name])
    speedup = compressed[best] / plain
    if speedup >= WORTH:
        return Choice(best, speedup, f"--grad-compression {best}: {speedup:.2f}x the samples/s "
                      "of plain DDP here")
    return Choice("none", 1.0, f"compression is not worth it here: the best ({best}) reached "
                  f"{speedup:.2f}x the samples/s of plain DDP (worth it from {WORTH:.2f}x)")


@dataclass(frozen=True)
class Split:
    """One process count's step, split."""

    step_s: float  # with gradient sync
    compute_s: float  # without (no-op hook)
    gradient_bytes: int | None
    world_size: int

    @property
    def comm_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s)

    @property
    def comm_fraction(self) -> float:
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def bound(self) -> str:
        return "communication" if self.comm_fraction >= COMM_BOUND else "compute"

    def bus_gbit(self) -> float | None:
        """Bus bandwidth the exposed communication time implies: 2(N-1)/N * S / t, in Gbit/s
        (a lower bound on the link's: overlap with the backward pass hides some of it)."""
        if not self.gradient_bytes or self.comm_s <= 0 or self.world_size < 2:
            return None
        return ring_bytes(self.gradient_bytes, self.world_size) * 8 / self.comm_s / 1e9


def ring_bytes(gradient_bytes: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``gradient_bytes``."""
    return 2 * (world_size - 1) / world_size * gradient_bytes


def ring_bound_s(gradient_bytes: int, world_size: int, link_gbit: float) -> float:
    """The ring all-reduce's lower bound on time over a ``link_gbit`` link."""
    return ring_bytes(gradient_bytes, world_size) * 8 / (link_gbit * 1e9)


def step_seconds(samples_per_s: float, global_batch: int) -> float:
    return global_batch / samples_per_s
