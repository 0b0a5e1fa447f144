"""The resident QLoRA baseline's model: what ``from_pretrained(..., quantization_config=BitsAndBytesConfig(
load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16))``
gives, built from random weights without a bf16 copy of the whole model.

A 70B model does not fit on one GPU in bf16 (140 GB), nor cheaply on the host. So the skeleton is built on the meta
device and materialized part by part on the device in bf16 with the bench's random init; each decoder layer's
``nn.Linear`` then becomes a ``bitsandbytes.nn.Linear4bit`` holding its weight quantized to NF4 (blocks of 64,
double-quantized absmax), as transformers' bitsandbytes quantizer makes it, and the layer's bf16 copy is freed
before the next layer. Embedding, norms and head stay bf16, as transformers leaves them (it never quantizes the
output embedding). The model is marked ``is_loaded_in_4bit``, so PEFT puts its own ``lora.Linear4bit`` over them.

``peft.prepare_model_for_kbit_training`` is not applied: besides freezing the base and enabling checkpointing (the
bench does both), it casts every bf16 parameter but the 4-bit ones to fp32, which puts the embedding, norms, head
and so the residual stream and the head GEMM in fp32 (4 GiB more on a 70B model, and slower). A user after speed
keeps them bf16, as the RoundPipe rows do: the strongest baseline.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

BLOCKSIZE = 64
"""NF4's block: one absmax per 64 weights (bitsandbytes' default, QLoRA's)."""


def qlora_refusal(model: nn.Module, lora_rank: int) -> Optional[str]:
    """Why a (meta-device) ``model`` gets no QLoRA baseline, or None: it needs LoRA, and bitsandbytes' 4-bit
    quantization covers ``nn.Linear`` weights only, so a mixture of experts' fused 3-D expert weights would stay
    bf16 (not the baseline a user would compare with)."""
    if not lora_rank:
        return "QLoRA trains LoRA adapters: add --lora N"
    experts = [n for n, p in model.named_parameters() if p.dim() > 2]
    if experts:
        return (
            f"bitsandbytes quantizes nn.Linear weights only, and {experts[0]} is a fused 3-D expert weight it would "
            "leave in bf16: run it on a dense workload"
        )
    return None


def quantize_linears(part: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace every plain ``nn.Linear`` of ``part`` (its weights materialized) by a ``bitsandbytes.nn.Linear4bit``
    holding that weight in NF4 with double-quantized scales, quantized on the weight's device as transformers'
    bitsandbytes loader does (``Params4bit(...).to(device)``). Returns how many were replaced."""
    import bitsandbytes as bnb

    found = [(name, sub) for name, sub in part.named_modules() if type(sub) is nn.Linear]
    for name, lin in found:
        q = bnb.nn.Linear4bit(
            lin.in_features,
            lin.out_features,
            lin.bias is not None,
            compute_dtype,
            compress_statistics=True,
            quant_type="nf4",
            device="meta",  # no throwaway fp32 weight: the real one is assigned below
        )
        w = lin.weight.data  # [out_features, in_features]
        q.weight = bnb.nn.Params4bit(w, requires_grad=False, **q.weight.__dict__).to(w.device)  # quantizes here
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
        q.requires_grad_(False)
        part.set_submodule(name, q)
    return len(found)


def build_qlora(
    model: nn.Module,
    init: Callable[[str, nn.Module], None],
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> nn.Module:
    """``model`` (a Hugging Face causal LM on the meta device) materialized on ``device`` part by part: each part
    (embedding, each decoder layer, final norm, head) in ``dtype``, filled by ``init(prefix, part)``, and each
    decoder layer's linears quantized to NF4 (:func:`quantize_linears`) before the next one is made, so at most one
    layer is ever in ``dtype``. The rotary tables are computed as the model's constructor computes them."""
    from roundpipe.loading.skeleton import parts_of

    why = qlora_refusal(model, 1)
    if why:
        raise ValueError(f"qlora: {why}")
    inner = model.model
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    model.to(dtype=dtype)  # on meta: no memory, only the dtype the parts are made in
    for prefix, part in parts_of(model):
        if part is inner.rotary_emb or (tied and part is head):
            continue  # the rotary tables are rebuilt below; a tied head is the embedding
        part.to_empty(device=device)
        init(prefix, part)
        if prefix.startswith("model.layers."):
            quantize_linears(part, compute_dtype=dtype)
    if tied:
        model.tie_weights()
    inner.rotary_emb = type(inner.rotary_emb)(config=model.config).to(device)  # fp32 tables, as at construction
    model.is_loaded_in_4bit = True  # what transformers' bitsandbytes quantizer sets: PEFT reads it
    return model


def held_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s base (every parameter but LoRA's) as held: each 4-bit weight's packed codes with its
    quantization state (absmax codes, their fp32 absmax, the code tables), every other one at its own size."""
    total = 0
    for p in {id(p): p for n, p in model.named_parameters() if "lora_" not in n}.values():
        state = getattr(p, "quant_state", None)
        total += p.nbytes + (
            0 if state is None else sum(t.nbytes for t in state.as_dict().values() if torch.is_tensor(t))
        )
    return total
