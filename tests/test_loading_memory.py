"""Peak host memory while a sharded checkpoint loads into NF4: at most the final footprint plus two decoder
layers in bf16, measured in a fresh process (its resident-set peak, ``VmHWM``, reset just before the load).

The final footprint is what the loaded model holds (packed NF4 bases, LoRA, embedding, norms, head): the peak
over the resident set just before the load must stay within it plus two bf16 layers. Materializing the model
first (transformers' load, then packing) peaks 26 MB above that start here, this loader 11 MB, against the
19 MB allowed (5.8 MB of model and two layers). The
model is three layers of 6.5 MB in bf16 (width 512), so the layers, not the allocator, make the difference.
About 10 s on 2 idle cores, 20-30 s on busy ones: the child's imports (transformers, peft: a fresh process,
so that its peak is the load's), then NF4 packing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

CHILD = r"""
import json, sys
import torch
from peft import LoraConfig
from roundpipe.loading import load_pretrained
from roundpipe.utils import host_nbytes

def status(field):
    with open("/proc/self/status") as f:
        return [int(line.split()[1]) * 1024 for line in f if line.startswith(field)][0]

lora = lambda: LoraConfig(r=4, target_modules="all-linear")
load_pretrained(sys.argv[2], "nf4", lora())  # first calls (model classes, safetensors) on a tiny copy
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set starts again from the current one
before = status("VmRSS")
model = load_pretrained(sys.argv[1], "nf4", lora(), torch.bfloat16)
tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
print(json.dumps(dict(before=before, peak=status("VmHWM"), model=sum(host_nbytes(t) for t in tensors))))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_loading_into_nf4_peaks_at_the_final_footprint_plus_two_layers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from roundpipe.models.configs import tiny_config

    config = tiny_config(
        "llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, head_dim=128, vocab_size=128,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.normal_(0.0, 0.02)
    model.save_pretrained(str(tmp_path / "model"), max_shard_size="5MB")
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(str(tmp_path / "warm"))
    env = dict(os.environ, PYTHONPATH=ROOT, MALLOC_MMAP_THRESHOLD_="65536")  # freed blocks go back at once
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "model"), str(tmp_path / "warm")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rss["peak"] - rss["before"] <= rss["model"] + 2 * layer, {k: v / 2**20 for k, v in rss.items()}
