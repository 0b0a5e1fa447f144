"""A causal LM call cut along the sequence into tiles (``RoundPipeRunConfig(sequence_tiles=T)``): the inputs
each tile needs to compute exactly its part of the unsplit call (``roundpipe.runtime.sequence`` runs them).

* Targets are shifted over the whole sequence first (``shift_labels``): a tile's last token predicts
  the next tile's first, which shifting inside each tile would lose.
* Positions are explicit (``position_ids``): tile t's rotary embedding starts where tile t-1's ended.
* No padding mask: a tile attends to every earlier token (an all-ones mask is dropped).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Tuple

import torch

from roundpipe.models.loss import shift_causal_labels
from roundpipe.runtime import sequence
from roundpipe.runtime.run_config import RoundPipeRunConfig


def tiles_of(run_config: RoundPipeRunConfig, model_run_config: RoundPipeRunConfig) -> int:
    """The call's tile count: its own ``sequence_tiles``, else the model's, else 1."""
    for cfg in (run_config, model_run_config):
        if cfg.sequence_tiles is not None:
            return cfg.sequence_tiles
    return 1


def tile_call(
    layer_kwargs: Dict[str, Any], run_config: RoundPipeRunConfig, tiles: int, config: Any
) -> Tuple[Dict[str, Any], RoundPipeRunConfig]:
    """The first layer's keyword arguments (``CausalLMPreset.layer_kwargs``) and the run config of a call
    cut into ``tiles`` tiles along the sequence; ``config``: the Hugging Face model's config."""
    impl = getattr(config, "_attn_implementation", "sdpa")
    if impl != "sdpa":
        raise ValueError(
            f"sequence_tiles needs the model's attention implementation 'sdpa' (it is {impl!r}); load the model "
            "with attn_implementation='sdpa'"
        )
    if layer_kwargs["options"].get("return_logits"):
        raise ValueError("sequence_tiles: a tiled call returns the loss only; drop return_logits (or sequence_tiles)")
    kwargs = dict(layer_kwargs)
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise ValueError("sequence_tiles: the batch has padding (attention_mask with zeros); tiles need unpadded rows")
    ref = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    rows, length = int(ref.shape[0]), int(ref.shape[1])
    if tiles > length:
        raise ValueError(f"sequence_tiles={tiles} is more than the sequence's {length} tokens; lower sequence_tiles")
    labels = kwargs.pop("labels", None)
    if labels is not None:
        kwargs["shift_labels"] = shift_causal_labels(labels)
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = torch.arange(length, device=ref.device).unsqueeze(0).expand(rows, length).contiguous()
    sequence.install_attention_router()
    cfg = dataclasses.replace(run_config, num_microbatch=tiles, split_input=split_along_sequence, sequence_tiles=tiles)
    return kwargs, cfg


def split_along_sequence(
    args: Tuple[Any, ...], kwargs: Dict[str, Any], n: int
) -> Tuple[List[Tuple[Any, ...]], List[Dict[str, Any]]]:
    """``split_input`` of a tiled call: every ``[batch, seq, ...]`` tensor cut into ``n`` tiles along dim 1
    (the first tiles one token longer when ``n`` does not divide the length); ``options`` to every tile."""
    tiles: List[Dict[str, Any]] = [{} for _ in range(n)]
    for name, value in kwargs.items():
        parts = torch.tensor_split(value, n, dim=1) if isinstance(value, torch.Tensor) else [value] * n
        for tile, part in zip(tiles, parts):
            tile[name] = part
    return [args] * n, tiles
