"""Tests of the ``roundpipe`` command line (``roundpipe.cli``)."""
