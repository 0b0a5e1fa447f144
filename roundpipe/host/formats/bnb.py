"""A base that Hugging Face quantized with bitsandbytes (``BitsAndBytesConfig(load_in_4bit=True)``), adopted as
it is: ``frozen.adopt_bnb_4bit`` makes each ``bitsandbytes.nn.Linear4bit`` an ``nn.Linear`` whose weight is a
FrozenWeight holding the ``Params4bit`` bytes and the quantization state's tensors unchanged (no
re-quantization), unpacked on the device by bitsandbytes' own ``dequantize_4bit`` (``Bnb4bitFormat``): the
weight every microbatch uses is the one bitsandbytes' matmul would have used. bitsandbytes is imported only
when such a weight is unpacked; where it cannot run there, the error is one line that says what to do instead.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from roundpipe.host.formats.codecs import Format, Packed


class Bnb4bitFormat(Format):
    """bitsandbytes' 4-bit packing of one weight (its block sizes and type are per weight, so each adopted
    weight has its own format object). Packed: ``data`` uint8 [numel / 2, 1], ``absmax``, ``code`` and, for
    double-quantized statistics, ``offset``, ``absmax2``, ``code2``."""

    def __init__(self, quant_type: str, blocksize: int, dtype: torch.dtype, blocksize2: Optional[int]) -> None:
        self.name = f"bnb-{quant_type}"
        self.quant_type, self.blocksize, self.dtype, self.blocksize2 = quant_type, blocksize, dtype, blocksize2

    def quantize(self, w: torch.Tensor) -> Packed:
        raise NotImplementedError("bitsandbytes weights are adopted as they are (adopt_bnb_4bit), not quantized here")

    def random(
        self, shape: Tuple[int, int], dtype: torch.dtype, std: float, generator: Any, device: Any = "cpu"
    ) -> Packed:
        raise NotImplementedError("random weights are built in base_format 'nf4', not in bitsandbytes' packing")

    def dequantize(
        self, packed: Packed, shape: Sequence[int], dtype: torch.dtype, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        try:
            import bitsandbytes.functional as bnbf

            state2 = None
            if "absmax2" in packed:
                state2 = bnbf.QuantState(
                    absmax=packed["absmax2"], code=packed["code2"], blocksize=self.blocksize2, dtype=torch.float32
                )
            state = bnbf.QuantState(
                absmax=packed["absmax"],
                shape=torch.Size(shape),
                code=packed["code"],
                blocksize=self.blocksize,
                quant_type=self.quant_type,
                dtype=self.dtype,
                offset=packed.get("offset"),
                state2=state2,
            )
            direct = out is not None and out.dtype == self.dtype and out.is_contiguous()
            w = bnbf.dequantize_4bit(packed["data"], state, out=out if direct else None)
        except Exception as e:  # noqa: BLE001 - any failure of bitsandbytes here has one remedy
            device = packed["data"].device
            raise RuntimeError(
                f"bitsandbytes cannot unpack its 4-bit weights on {device} ({type(e).__name__}: {e}); load the model "
                "without BitsAndBytesConfig and pass base_format='nf4' instead"
            ) from None
        if out is None:
            return w.to(dtype)
        if not direct:
            out.copy_(w)
        return out


def is_linear4bit(mod: nn.Module) -> bool:
    """Whether ``mod`` is a bitsandbytes ``Linear4bit`` (told by its class, without importing bitsandbytes)."""
    return type(mod).__name__ == "Linear4bit" and type(mod).__module__.startswith("bitsandbytes")


def bnb_packed(weight: Any) -> Tuple[Packed, Bnb4bitFormat]:
    """The ``Params4bit``'s bytes and quantization state as host tensors, and their format."""
    qs = weight.quant_state
    if qs is None or not getattr(weight, "bnb_quantized", True):
        raise ValueError("a bitsandbytes Linear4bit weight is not quantized yet; load the model with its config")
    packed: Dict[str, torch.Tensor] = {
        "data": weight.data.detach().cpu(),
        "absmax": qs.absmax.cpu(),
        "code": qs.code.cpu(),
    }
    blocksize2 = None
    if qs.nested:
        packed.update(
            offset=torch.as_tensor(qs.offset).cpu(), absmax2=qs.state2.absmax.cpu(), code2=qs.state2.code.cpu()
        )
        blocksize2 = qs.state2.blocksize
    return packed, Bnb4bitFormat(qs.quant_type, qs.blocksize, qs.dtype, blocksize2)
