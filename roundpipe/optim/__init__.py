"""Everything that runs on the optimizer thread: the thread itself (``thread``), the step protocol
(``step``: what ``model.step`` does with gradients and parameters), the host Adam (``adam``, its C++
kernel in ``csrc/`` built by ``build``) and the GradScaler (``grad_scaler``).

The public surface: ``Adam`` (torch.optim.Adam's behaviour, fast fp32 stepping on the host),
``GradScaler`` and ``accept_low_precision_grad`` (how an optimizer declares that it reads bfloat16
gradients of fp32 parameters, so the step hands the host buffer over instead of copying it) and
``step_fn_zeroes_grads`` (how a step function declares that it zeroes the gradients after stepping, so the
optimizer may write the new weights into their staging buffer in its own pass).
"""

from roundpipe.optim.adam import Adam
from roundpipe.optim.grad_scaler import GradScaler
from roundpipe.optim.step import accept_low_precision_grad, step_fn_zeroes_grads

__all__ = ["Adam", "GradScaler", "accept_low_precision_grad", "step_fn_zeroes_grads"]
