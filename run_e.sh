#!/bin/bash
# h200-x2: qwen3-4b 2 GPUs after the sync-free loss; data parallel 1 vs 2 ranks (default threads); qwen3-8b 2 GPUs.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
END=$((SECONDS+515))
left() { echo $((END-SECONDS)); }
RPP_OPTIM_THREADS=16 timeout 140 python3 bench/train_bench.py --workload qwen3-4b --skip-baseline --warmup 3 --iters 4 > $OUT/b4_2gpu.log 2>&1
grep -E "thread CPU|plan:|simulated|per-iteration|optimizer step|^\| roundpipe" $OUT/b4_2gpu.log
echo "== left $(left) s"
A="--model qwen3-1.7b --seq 4096 --steps 12 --warmup 3 --batch-per-rank 8 --gpus-per-rank 1"
timeout 110 torchrun --standalone --nproc-per-node 1 bench/dp_bench.py $A --out $OUT/one.json > $OUT/one.log 2>&1; tail -3 $OUT/one.log
timeout 130 torchrun --standalone --nproc-per-node 2 bench/dp_bench.py $A --reduce-on device --out $OUT/two.json > $OUT/two.log 2>&1; tail -4 $OUT/two.log
python3 bench/dp_bench.py --compare $OUT/one.json $OUT/two.json 2>&1 | tail -8
echo "== left $(left) s"
timeout $(( $(left) - 3 )) python3 bench/train_bench.py --workload qwen3-8b --skip-baseline --warmup 3 --iters 2 > $OUT/b8_2gpu.log 2>&1
grep -E "thread CPU|plan:|per-iteration|optimizer step|^\| roundpipe" $OUT/b8_2gpu.log
echo "== left $(left) s"
