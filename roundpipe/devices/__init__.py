"""The device layer: the workers (one ``DeviceManager`` per GPU or CPU worker, with its controller thread and streams),
the compute backend they run on, the host-side streams and threads, pinned host memory, the profiler hook, the
dispatcher that hands callables to workers, and the per-device CUDA graph cache. It runs whatever callable it is
handed and knows nothing of plans, runs, optimizers or models: it imports only ``roundpipe.settings`` and
``roundpipe.utils`` from above its folder.
"""
