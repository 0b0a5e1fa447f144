"""Loading without materializing: a Hugging Face checkpoint directory, or a config with random weights,
built layer by layer into host storage with its frozen base in a base format (``roundpipe.from_pretrained``,
``roundpipe.from_config``)."""

from roundpipe.loading.load import build_random, from_config, from_pretrained, load_pretrained
from roundpipe.loading.shards import LoadError

__all__ = ["LoadError", "build_random", "from_config", "from_pretrained", "load_pretrained"]
