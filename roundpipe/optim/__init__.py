"""RoundPipe's host (CPU) optimizers: torch.optim behaviour, fast fp32 stepping on the host."""

from roundpipe.optim.adam import Adam

__all__ = ["Adam"]
