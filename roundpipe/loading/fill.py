"""Fill one part of a meta-device skeleton (the embedding, a decoder layer, the norm, the head) with real
tensors on the host: read from a checkpoint or drawn at random, the frozen weights the base format packs (its
``default_targets``: the Linear weights, or for mxfp4 on a mixture of experts the expert weights) stored in it,
the LoRA adapters initialised as PEFT initialises them. An expert weight the checkpoint holds as MXFP4
(GPT-OSS's ``<name>_blocks`` and ``<name>_scales``) is kept as those bytes under mxfp4 (no re-quantization) and
dequantized as transformers does otherwise.

Tensors are read one at a time, each file open only while one is read, and a frozen weight is in its format
before the next is read: no more than one tensor of the checkpoint is ever in the compute dtype, besides the
parts kept in it (embedding, norms, head). LoRA draws the same random numbers in the same order as
``peft.get_peft_model`` on a materialized model (each adapter's two ``nn.Linear`` constructors, then
``reset_lora_parameters``, in module order; the adapters of ``target_parameters`` after all the others, as PEFT
adds them), so a seeded load gives PEFT's adapters bit for bit.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from roundpipe.loading.shards import CheckpointFiles, LoadError

#: Name segments of adapter parameters: initialised by the LoRA rule, never read from the base checkpoint.
ADAPTER_SEGMENTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")

#: Buffers that older checkpoints carry and transformers ignores (computed at init).
IGNORED_KEYS = ("rotary_emb.inv_freq",)


def checkpoint_name(name: str) -> str:
    """The checkpoint's key of a skeleton parameter: PEFT's ``base_layer`` levels removed (one per adapted
    parameter of a module: ``experts.base_layer.base_layer.down_proj`` with two ``target_parameters``)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def is_adapter(name: str) -> bool:
    return any(f".{seg}." in f".{name}." for seg in ADAPTER_SEGMENTS)


def adapter_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype PEFT gives adapters over a base in ``dtype``: bf16 and fp16 upcast to fp32
    (``get_peft_model``'s ``autocast_adapter_dtype``)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


#: Suffixes of an MXFP4 expert weight's two tensors in a GPT-OSS checkpoint.
MXFP4_PARTS = ("_blocks", "_scales")


def frozen_value(t: torch.Tensor, base_format: str, transposed: bool = False) -> torch.Tensor:
    """A frozen weight as host storage in ``base_format`` (bf16: the tensor itself); ``transposed``: an expert
    weight [experts, in, out] (``FrozenWeight.quantize``)."""
    if base_format == "bf16":
        return t
    from roundpipe.host.formats import FrozenWeight

    return FrozenWeight.quantize(t, base_format, transposed=transposed)


def random_frozen(
    shape: torch.Size, base_format: str, dtype: torch.dtype, std: float, transposed: bool = False
) -> torch.Tensor:
    """A random frozen weight N(0, std) built straight into ``base_format`` (no bf16 copy). Drawn on the
    first GPU where there is one: one host thread draws a 70B model's bytes in minutes, a GPU in seconds."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if base_format == "bf16":
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std).cpu()
    from roundpipe.host.formats import FrozenWeight

    return FrozenWeight.random(tuple(shape), base_format, dtype=dtype, std=std, device=device, transposed=transposed)


class PartFiller:
    """Fills parts of one skeleton (see the module docstring); ``files`` None: random weights."""

    def __init__(
        self,
        hf: nn.Module,
        dtype: torch.dtype,
        base_format: str,
        files: Optional[CheckpointFiles],
        lora: Optional[Any],
        skip: Tuple[str, ...] = ("lm_head",),
    ) -> None:
        from roundpipe.loading.skeleton import tied_names

        self.hf, self.dtype, self.base_format, self.files, self.lora, self.skip = (
            hf,
            dtype,
            base_format,
            files,
            lora,
            skip,
        )
        self.tied = tied_names(hf)
        self.loaded: Dict[str, nn.Parameter] = {}  # tied parameters already filled, by every name of theirs
        self.used: set = set()  # checkpoint keys read
        self.deferred: List[Any] = []  # adapters of parameters (PEFT's ParamWrapper), drawn after the module ones
        config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
        self.std = float(getattr(config, "initializer_range", None) or 0.02)
        from roundpipe.host.formats import default_targets

        self.targets = ("linear",) if base_format == "bf16" else default_targets(hf, base_format)

    def layout(self, owner: nn.Module, attr: str, name: str, param: nn.Parameter) -> Optional[bool]:
        """None unless ``name`` is a frozen weight that goes into the base format; then whether it is stored
        transposed (an expert weight [experts, in, out]; a Linear weight is not)."""
        from roundpipe.host.formats import expert_layout

        if param.requires_grad or name.split(".")[0] in self.skip:
            return None
        if isinstance(owner, nn.Linear) and attr == "weight":
            return False if "linear" in self.targets else None
        transposed = expert_layout(owner, attr)
        return transposed if transposed is not None and "experts" in self.targets else None

    def fill(self, prefix: str, part: nn.Module) -> None:
        """Give every parameter and buffer of ``part`` (named ``prefix``...) real host storage."""
        from roundpipe.loading.skeleton import materialize_buffers

        slots: List[Tuple[str, nn.Module, str, nn.Parameter]] = []
        for sub_name, sub in part.named_modules(remove_duplicate=False):
            for attr, p in sub._parameters.items():
                if p is not None:
                    slots.append((prefix + (f"{sub_name}." if sub_name else "") + attr, sub, attr, p))
        base = [s for s in slots if not is_adapter(s[0])]
        keys = self._keys(base) if self.files is not None else {}
        randomized: List[nn.Module] = []
        for name, owner, attr, p in base:
            if name in self.loaded:  # the head tied to the embedding: the same tensor
                owner._parameters[attr] = self.loaded[name]
                continue
            transposed = self.layout(owner, attr, name, p)
            if self.files is not None and keys[name].endswith(MXFP4_PARTS[0]):
                value = self._mxfp4_tensor(keys[name], p, transposed)
            elif self.files is not None:
                # One tensor at a time: read, stored in its format, and only then the next one.
                t = self._tensor(keys[name], p.shape)
                value = frozen_value(t, self.base_format, bool(transposed)) if transposed is not None else t
                del t
            elif transposed is not None:
                value = random_frozen(p.shape, self.base_format, p.dtype, self.std, transposed)
            else:
                value = torch.empty(p.shape, dtype=p.dtype)
                randomized.append(owner)
            new = nn.Parameter(value, requires_grad=p.requires_grad)
            if self.files is None and transposed is not None:
                # drawn already: the owner's init (for its other tensors, a bias) leaves it alone, as transformers'
                # init skips a tensor so flagged (a packed one has no in-place init)
                new._is_hf_initialized = True
            owner._parameters[attr] = new
            for other in self.tied.get(name, []):
                self.loaded[other] = new
        for owner in dict.fromkeys(randomized):  # the model's own init, once per module
            self.hf._init_weights(owner)
        self._init_adapters(part)
        materialize_buffers(self.hf, part, prefix)
        later = {id(p) for sub in self.deferred for p in sub.parameters() if p.requires_grad}
        left = [n for n, t in part.named_parameters() if t.is_meta and id(t) not in later]
        left += [n for n, t in part.named_buffers() if t.is_meta]
        if left:
            raise LoadError(f"{prefix}{left[0]} was left unfilled by the loader; wrap the loaded model instead")

    def _keys(self, base: List[Tuple[str, nn.Module, str, nn.Parameter]]) -> Dict[str, str]:
        """Skeleton name -> checkpoint key of this part's base tensors (all present, or an error naming the key)."""
        assert self.files is not None
        keys: Dict[str, str] = {}
        for name, _, _, _ in base:
            if name in self.loaded:
                continue
            key = checkpoint_name(name)
            if key not in self.files.where and all(key + part in self.files.where for part in MXFP4_PARTS):
                key += MXFP4_PARTS[0]  # an MXFP4 expert weight (GPT-OSS): its blocks, the scales beside them
            if key not in self.files.where:  # a tied tensor is stored under one of its names
                others = [checkpoint_name(o) for o in self.tied.get(name, [])]
                key = next((o for o in others if o in self.files.where), key)
            if key not in self.files.where:
                raise LoadError(
                    f"the checkpoint in {self.files.path} has no tensor {key!r}, which {type(self.hf).__name__} needs; "
                    "pass the directory of a checkpoint of this model (its config.json and weights together)"
                )
            keys[name] = key
        return keys

    def _tensor(self, key: str, shape: torch.Size) -> torch.Tensor:
        """Checkpoint tensor ``key`` in the compute dtype, its shape checked against the skeleton's."""
        assert self.files is not None
        t = self.files.read([key], self.dtype)[key]
        if t.shape != shape:
            raise LoadError(
                f"{key} in {self.files.file_of(key)} has shape {tuple(t.shape)}, but the model's config gives "
                f"{tuple(shape)}; the config.json does not belong to these weights"
            )
        self.used.add(key)
        return t

    def _mxfp4_tensor(self, key: str, p: nn.Parameter, transposed: Optional[bool]) -> torch.Tensor:
        """The expert weight stored as MXFP4 blocks (``key``) and scales: those bytes as they are under mxfp4,
        else dequantized to the compute dtype (transformers' values) and stored in the base format."""
        from roundpipe.host.formats import adopt_mxfp4

        assert self.files is not None
        scales_key = key[: -len(MXFP4_PARTS[0])] + MXFP4_PARTS[1]
        parts = self.files.read([key, scales_key], None)
        self.used.update((key, scales_key))
        try:
            fw = adopt_mxfp4(parts[key], parts[scales_key], self.dtype)
        except ValueError as exc:
            raise LoadError(f"{key} in {self.files.file_of(key)}: {exc}") from None
        if fw.shape != p.shape:
            raise LoadError(
                f"{key} in {self.files.file_of(key)} holds an MXFP4 weight of shape {tuple(fw.shape)}, but the "
                f"model's config gives {tuple(p.shape)}; the config.json does not belong to these weights"
            )
        if self.base_format == "mxfp4" and transposed:
            return fw
        plain = fw.dequantize(dtype=self.dtype)
        return frozen_value(plain, self.base_format, bool(transposed)) if transposed is not None else plain

    def _init_adapters(self, part: nn.Module) -> None:
        """PEFT's LoRA init of every adapter in ``part``, in module order (see the module docstring)."""
        if self.lora is None:
            return
        from peft.tuners.lora.layer import LoraLayer, ParamWrapper

        done: set = set()
        for outer in part.modules():
            # Several adapted parameters of one module nest (``experts`` wraps ``experts.base_layer``, one
            # ParamWrapper per ``target_parameters`` entry): PEFT creates the innermost first, so it draws first.
            chain, sub = [], outer
            while isinstance(sub, LoraLayer) and id(sub) not in done:
                chain.append(sub)
                done.add(id(sub))
                sub = sub.base_layer
            for sub in reversed(chain):
                if sub.lora_embedding_A or getattr(sub, "lora_variant", None):
                    raise LoadError(
                        f"LoRA on {type(sub.get_base_layer()).__name__} layers or with a variant is not supported by "
                        "the loader; target Linear layers only (--lora-targets / target_modules)"
                    )
                if isinstance(sub, ParamWrapper):
                    # PEFT adapts every target_modules entry of the whole model before any target_parameters one.
                    self.deferred.append(sub)
                    continue
                for adapter in list(sub.lora_A):
                    self._init_adapter(sub, adapter)

    def finish_adapters(self) -> None:
        """Draw the adapters of adapted parameters (``target_parameters``), after every part is filled: PEFT draws
        them after all the module adapters, module by module, so a seeded load still gives PEFT's adapters."""
        for sub in self.deferred:
            for adapter in list(sub.lora_A):
                self._init_adapter(sub, adapter)
        self.deferred.clear()

    def _init_adapter(self, sub: Any, adapter: str) -> None:
        a_meta, b_meta = sub.lora_A[adapter].weight, sub.lora_B[adapter].weight
        # The draws of update_layer: nn.Linear(in, rows) then nn.Linear(rows, out) in the default dtype, then the
        # reset. rows is r, or r per expert on an experts' 3-D parameter (PEFT's ParamWrapper stacks them).
        rows = sub.r[adapter] * getattr(sub, "num_experts", 1)
        a = nn.Linear(sub.in_features, rows, bias=False, device="cpu")
        b = nn.Linear(rows, sub.out_features, bias=sub.lora_bias[adapter], device="cpu")
        sub.lora_A[adapter]._parameters["weight"] = a.weight
        sub.lora_B[adapter]._parameters["weight"] = b.weight
        if b.bias is not None:
            sub.lora_B[adapter]._parameters["bias"] = b.bias
        init = self.lora.init_lora_weights
        if init is not False:
            with torch.no_grad():
                sub.reset_lora_parameters(adapter, init)
        final = adapter_dtype(self.dtype)
        for mod, meta in ((sub.lora_A[adapter], a_meta), (sub.lora_B[adapter], b_meta)):
            for attr, p in list(mod._parameters.items()):
                if p is None:
                    continue
                # PEFT casts the adapter to the base layer's dtype, then upcasts a bf16/fp16 one to fp32.
                value = p.detach().to(self.dtype).to(final)
                mod._parameters[attr] = nn.Parameter(value, requires_grad=meta.requires_grad)

    def check_unused(self) -> None:
        """Every checkpoint tensor went somewhere (transformers' unexpected keys, as an error)."""
        if self.files is None:
            return
        extra = [k for k in self.files.keys() if k not in self.used and not k.endswith(IGNORED_KEYS)]
        if extra:
            raise LoadError(
                f"{self.files.file_of(extra[0])} holds {extra[0]!r}"
                + (f" and {len(extra) - 1} more tensors" if len(extra) > 1 else "")
                + f" that {type(self.hf).__name__} of this config has no place for; the config.json does not "
                "belong to these weights"
            )


__all__ = ["ADAPTER_SEGMENTS", "PartFiller", "adapter_dtype", "checkpoint_name", "frozen_value", "random_frozen"]
