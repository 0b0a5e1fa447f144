"""Dispatch: which device runs each job (one layer group over all microbatches of a call).

The core asks a ``DispatchPolicy``; ``RoundRobin`` implements it: the k-th job dispatched in this
process (counting across calls and models) runs on device ``k mod N``. A call assigns all its jobs
before launching any, so each job knows where its consumer runs (an activation or a gradient bound for
the same device stays there instead of going through the host). The planner's model of a call
(``roundpipe.planning.simulate``) asks the same policy, through ``devices_for``.

Determinism contract (data parallel relies on it; ``tests/test_dispatch.py`` pins it): the assignment
depends only on the position (:meth:`DispatchPolicy.position`) and the number of jobs asked for, never
on timing. Ranks that start a call at the same position with the same plan give device k the same jobs
in the same order, so the collectives device k issues match across ranks; :meth:`DispatchPolicy.seek`
lets a rank adopt another rank's position.

Only the main thread (the thread that calls the model) assigns; device threads never do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Protocol, runtime_checkable

from roundpipe.devices import device as device_mod

if TYPE_CHECKING:
    from roundpipe.devices.device import DeviceManager


@runtime_checkable
class DispatchPolicy(Protocol):
    """Which device of the pool runs each job (see the module docstring for the contract)."""

    def devices_for(self, n_jobs: int, num_devices: int, position: int) -> List[int]:
        """The device index of each of ``n_jobs`` jobs dispatched from ``position`` on a pool of
        ``num_devices``: a pure function (the planner simulates calls with it)."""

    def assign(self, n_jobs: int) -> List["DeviceManager"]:
        """The devices of the next ``n_jobs`` jobs, in order; advances the position."""

    def position(self) -> int:
        """Where the next job goes (what ``seek`` takes)."""

    def seek(self, position: int) -> None:
        """Continue from ``position`` (data parallel: adopt rank 0's)."""

    def reset(self) -> None:
        """Start again (the pool was re-created)."""


class RoundRobin:
    """Round-robin assignment of jobs to the devices of the pool: job k on device k mod N."""

    def __init__(self) -> None:
        self._position = 0

    def devices_for(self, n_jobs: int, num_devices: int, position: int = 0) -> List[int]:
        return [(position + k) % num_devices for k in range(n_jobs)]

    def assign(self, n_jobs: int) -> List["DeviceManager"]:
        devices = device_mod.get_devices()
        out = [devices[k] for k in self.devices_for(n_jobs, len(devices), self._position)]
        self._position = (self._position + n_jobs) % len(devices)
        return out

    def position(self) -> int:
        return self._position

    def seek(self, position: int) -> None:
        self._position = position % device_mod.get_num_devices()

    def reset(self) -> None:
        self._position = 0


Dispatcher = RoundRobin  # the name earlier releases used

dispatcher: DispatchPolicy = RoundRobin()
device_mod.on_reset(dispatcher.reset)
