"""Kept import path: ``roundpipe.device`` is ``roundpipe.devices.device``
(``roundpipe.device.get_num_devices()`` in the user docs).
The very module object, not a copy, so its globals and monkeypatches are shared."""

import sys

# The real module, and the documented names for readers and type checkers:
from roundpipe.devices import device as _real
from roundpipe.devices.device import DeviceManager, device_list, get_devices, get_num_devices  # noqa: F401

sys.modules[__name__] = _real
