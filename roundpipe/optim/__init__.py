"""The optimizer math that runs on the optimizer thread: the host Adam (``adam``, its fp32 step ``fp32_step``, its
compact state ``compact`` and ``quant``, its C++ kernel in ``csrc/`` built by ``build``) and the GradScaler
(``grad_scaler``). The thread itself and the step protocol (what ``model.step`` does with gradients and
parameters) are the host side's: ``roundpipe.host``.

The public surface: ``Adam`` (torch.optim.Adam's behaviour, fast fp32 stepping on the host),
``GradScaler`` and ``accept_low_precision_grad`` (how an optimizer declares that it reads bfloat16
gradients of fp32 parameters, so the step hands the host buffer over instead of copying it) and
``step_fn_zeroes_grads`` (how a step function declares that it zeroes the gradients after stepping, so the
optimizer may write the new weights into their staging buffer in its own pass).
"""

from roundpipe.host.step import accept_low_precision_grad, step_fn_zeroes_grads
from roundpipe.optim.adam import Adam
from roundpipe.optim.grad_scaler import GradScaler

__all__ = ["Adam", "GradScaler", "accept_low_precision_grad", "step_fn_zeroes_grads"]
