"""The runtime layer: one forward/backward of a model over its microbatches. It splits and merges batches, builds the
jobs of each stage and hands them to the device layer, moves parameters, activations and gradients between host and
devices (``transfer``, ``host_buffers``, ``stage_codec``), tracks and reduces gradients (``tracker``,
``partial_grads``, ``tied_grads``, ``grad_sync``), and drives the step cycle with the optimizer through
``roundpipe.optim``'s public face.
"""
