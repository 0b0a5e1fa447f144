"""Dispatch: which device runs each job (one layer group over all microbatches of a call).

The policy is round robin over the device pool, in dispatch order: the k-th job dispatched in this
process (counting across calls and models) runs on device ``k mod N``. A call assigns all its jobs
before launching any, so each job knows where its consumer runs (an activation or a gradient bound for
the same device stays there instead of going through the host).

Determinism contract (data parallel relies on it): the assignment depends only on the position
(:meth:`Dispatcher.position`) and the number of jobs asked for, never on timing. Ranks that start a call
at the same position with the same plan give device k the same jobs in the same order, so the
collectives device k issues match across ranks; :meth:`Dispatcher.seek` lets a rank adopt another
rank's position.

Only the main thread (the thread that calls the model) assigns; device threads never do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from roundpipe import device as device_mod

if TYPE_CHECKING:
    from roundpipe.device import DeviceManager


class Dispatcher:
    """Round-robin assignment of jobs to the devices of the pool (see the module docstring)."""

    def __init__(self) -> None:
        self._position = 0

    def assign(self, n_jobs: int) -> List["DeviceManager"]:
        """The devices of the next ``n_jobs`` jobs, in order; advances the position by ``n_jobs``."""
        devices = device_mod.get_devices()
        out = [devices[(self._position + k) % len(devices)] for k in range(n_jobs)]
        self._position = (self._position + n_jobs) % len(devices)
        return out

    def position(self) -> int:
        """Index of the device the next job goes to."""
        return self._position

    def seek(self, position: int) -> None:
        """Make the next job go to device ``position mod N`` (data parallel: adopt rank 0's position)."""
        self._position = position % device_mod.get_num_devices()

    def reset(self) -> None:
        """Start again at device 0 (the pool was re-created)."""
        self._position = 0


dispatcher = Dispatcher()
device_mod.on_reset(dispatcher.reset)
