"""The host side of training: each parameter's host buffers and their roles, the per-layer events that order
them between threads, the optimizer thread, the step protocol, the step cycle and the step mode (the buffer
policy, resolved once per model). Imports only the settings, the small helpers and ``roundpipe.devices``."""
