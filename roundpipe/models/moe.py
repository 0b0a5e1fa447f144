"""Mixture-of-experts support of the causal-LM presets: the router description (``MoESpec``) and the
router statistics from which the presets rebuild transformers' load-balancing (aux) loss per stage."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import nn


@dataclass(frozen=True)
class MoESpec:
    """What the preset needs to reproduce Hugging Face's router load-balancing (aux) loss.

    Attributes:
        router_class: Module class whose output ``[output_index]`` is a layer's router logits (from the
            base model's ``_can_record_outputs["router_logits"]``).
        output_index: Index of the router logits in that module's output.
        num_experts: Experts per MoE layer.
        top_k: Experts selected per token.
        aux_loss_coef: ``router_aux_loss_coef``.
        output_router_logits: Config default for computing the aux loss.
    """

    router_class: type
    output_index: int
    num_experts: int
    top_k: int
    aux_loss_coef: float
    output_router_logits: bool


def moe_spec(model: nn.Module) -> Optional[MoESpec]:
    """Router description of an MoE ``*ForCausalLM``, None for a dense model.

    Found through the base model's ``_can_record_outputs["router_logits"]`` recorder (how transformers
    itself collects router logits) and the ``num_experts`` / ``num_experts_per_tok`` /
    ``router_aux_loss_coef`` attributes the MoE ``*ForCausalLM`` classes set.
    """
    recorder = (getattr(type(model.model), "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None or not hasattr(model, "router_aux_loss_coef"):
        return None
    return MoESpec(
        router_class=recorder.target_class,
        output_index=recorder.index or 0,
        num_experts=int(model.num_experts),
        top_k=int(model.num_experts_per_tok),
        aux_loss_coef=float(model.router_aux_loss_coef),
        output_router_logits=bool(getattr(model.config, "output_router_logits", False)),
    )


# ---------------------------------------------------------------------------------------------------------
# Router statistics (MoE aux loss)
# ---------------------------------------------------------------------------------------------------------

router_sink = threading.local()


def _capture_router_logits(module: nn.Module, args: Any, output: Any, index: int) -> None:
    """Forward hook on router modules: hands the router logits to the stage running in this thread."""
    sink = getattr(router_sink, "logits", None)
    if sink is not None:
        sink.append(output[index] if isinstance(output, (tuple, list)) else output)


def hook_routers(layer: nn.Module, moe: MoESpec) -> int:
    """Install (once) the capture hook on the router modules of ``layer``; returns how many there are."""
    routers = [m for m in layer.modules() if isinstance(m, moe.router_class)]
    for m in routers:
        if not getattr(m, "_roundpipe_router_hook", False):
            m.register_forward_hook(functools.partial(_capture_router_logits, index=moe.output_index))
            m._roundpipe_router_hook = True
    return len(routers)


RouterStats = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def accumulate_router_stats(
    stats: RouterStats, router_logits: torch.Tensor, attention_mask: Optional[torch.Tensor], moe: MoESpec
) -> RouterStats:
    """Add one MoE layer's routing to the running sums of transformers' ``load_balancing_loss_func``.

    Returns ``(tokens_per_expert_sum, router_prob_sum, total_rows)``; only ``router_prob_sum`` carries a
    gradient. The same operations in the same order as transformers, so the sums match it.
    """
    tokens, probs, rows = stats
    weights = torch.softmax(router_logits, dim=-1)
    _, selected = torch.topk(weights, moe.top_k, dim=-1)
    if attention_mask is None:
        # Expert counts by scatter_add, not bincount: bincount sizes its output from the data, which on
        # a GPU makes the host wait; the counts are small integers, exact in float32 either way.
        ones = torch.ones(selected.numel(), dtype=torch.float32, device=weights.device)
        tokens = tokens + torch.zeros(moe.num_experts, dtype=torch.float32, device=weights.device).scatter_add_(
            0, selected.reshape(-1), ones
        )
        probs = probs + weights.float().sum(dim=0)
        rows = rows + weights.shape[0]
    else:
        mask = attention_mask.reshape(-1).to(device=weights.device, dtype=torch.float32)
        tokens = tokens + torch.zeros(moe.num_experts, dtype=torch.float32, device=weights.device).scatter_add_(
            0, selected.reshape(-1), mask.repeat_interleave(moe.top_k)
        )
        probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + mask.sum()
    return tokens, probs, rows


def router_aux_loss(tokens: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, num_experts: int) -> torch.Tensor:
    """transformers' load-balancing loss from the summed statistics."""
    return torch.sum(tokens / rows * (probs / rows).unsqueeze(0)) * num_experts
