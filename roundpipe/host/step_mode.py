"""The step mode: how asynchronous steps hand their update to the next iteration, resolved once per model.

``staged`` (the default): the step stages each parameter's next version in the model dtype and the next
step publishes it, so training is one step stale; a gradient download may take the weights' host buffer
when one training call runs per step (``step_cycle.StepCycle``). ``streamed``: each layer goes to the next
forward as soon as the optimizer has stepped it, nothing is stale and nothing is staged; a gradient
download that finds no spare buffer waits for the step to release the one it holds. Either way a
parameter has one host buffer in the model dtype besides its weights in the steady state of one training
call per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from roundpipe import settings


@dataclass(frozen=True)
class StepMode:
    """The buffer policy of one model's asynchronous steps (``RPP_STEP_MODE``)."""

    streamed: bool = False
    """Each layer goes to the next forward as the optimizer steps it (no staging)."""
    fused_staging: str = "auto"
    """Staged steps: whether the optimizer writes the staging buffers in its own pass (``RPP_DEBUG_FUSED_STAGING``:
    ``1`` always, ``0`` never, ``auto`` for step functions declared with ``step_fn_zeroes_grads``)."""

    @classmethod
    def resolve(cls) -> "StepMode":
        """The mode the settings name (``RPP_STEP_MODE``, ``RPP_DEBUG_FUSED_STAGING``); a bad value raises
        ``ValueError`` naming its variable, so it fails when the model is built."""
        return cls(streamed=settings.STEP_MODE.get() == "streamed", fused_staging=settings.DEBUG_FUSED_STAGING.get())

    @property
    def staged(self) -> bool:
        """Asynchronous steps stage the updated parameters for the next step's publish; gradient downloads
        may then take the weights' buffers (the weights move to the buffer the step stages into)."""
        return not self.streamed

    @property
    def host_buffers_besides_weights(self) -> int:
        """Model-dtype host buffers per trainable parameter besides its weights in the steady state of one
        training call per step (what the estimate counts): staged, the gradient download that the step then
        stages into (the weights' buffer takes the next download); streamed, the one gradient buffer."""
        return 1
