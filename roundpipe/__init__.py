"""roundpipe: train models larger than GPU memory by streaming layers to a round-robin pool of devices."""
