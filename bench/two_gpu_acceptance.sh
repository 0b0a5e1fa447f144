#!/usr/bin/env bash
# The acceptance runs that need two GPUs of one host and 256 GiB of host memory (nvidia-h200-x2):
# issue 5 (plans on 2 GPUs), issue 6 (qwen3-4b on 1 vs 2 GPUs, qwen3-8b), issue 9 (two data-parallel
# ranks vs one). Each part fits one 10-minute device call; run them one by one:
#
#     bash bench/two_gpu_acceptance.sh tests|bound|peer|opt|grads|ab|threads|scale|4b|8b|8b1|8b2|plans|dp
#
# Results go to stdout (the tables of docs/benchmarks.md) and, for dp, to JSON files in $OUT (or .).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-.}
# Every run's whole output also goes to $out/PART.log (the tails below are what the reply shows).
log="$out/${1:-none}.log"
bench() { python3 bench/train_bench.py "$@" 2>&1 | grep -v -i "warn" | grep -v "^ *[0-9.]* ms at" | tee -a "$log"; }
# tbench SECONDS ARGS...: bench under a time limit (a function cannot be given to timeout(1))
tbench() { timeout "$1" python3 bench/train_bench.py "${@:2}" 2>&1 | grep -v -i "warn" | grep -v "^ *[0-9.]* ms at" | tee -a "$log"; }

case "${1:-}" in
  tests)  # the GPU tests, the 2-GPU ones included
    python3 -m pytest -m gpu tests/test_gpu.py tests/test_loss.py -q -p no:cacheprovider 2>&1 | tail -5 ;;
  scale)  # issue 19: qwen3-1.7b and qwen3-4b, 16 x 4096, 2 GPUs >= 1.85x one GPU of the same machine
    # (SCALE_NOSPLIT=1: also 2 GPUs with the fused job unsplit, RPP_DEBUG_SPLIT_FUSED=0; SCALE_MODELS picks models)
    for w in ${SCALE_MODELS:-qwen3-1.7b qwen3-4b}; do
      CUDA_VISIBLE_DEVICES=0 bench --workload $w --batch 16 --skip-baseline --warmup 3 --iters 4 | tail -4
      bench --workload $w --batch 16 --skip-baseline --warmup 3 --iters 4 | tail -4
      [ -n "${SCALE_NOSPLIT:-}" ] && RPP_DEBUG_SPLIT_FUSED=0 bench --workload $w --batch 16 --skip-baseline --warmup 3 --iters 4 | tail -1
      # SCALE_MB=K: also 2 GPUs with K microbatches (default 2 per device: 4 on 2 GPUs)
      [ -n "${SCALE_MB:-}" ] && bench --workload $w --batch 16 --microbatches "$SCALE_MB" --skip-baseline --warmup 3 --iters 4 | tail -2
    done ;;
  4b)  # issue 6: qwen3-4b on 2 GPUs >= 1.85x one GPU of the same machine
    CUDA_VISIBLE_DEVICES=0 bench --workload qwen3-4b --skip-baseline --warmup 3 --iters 3 | tail -4
    bench --workload qwen3-4b --skip-baseline --compare-layers --warmup 3 --iters 3 | tail -5 ;;
  8b)  # issue 6: qwen3-8b on 1 GPU with the baseline, within 18 bytes/param of host memory
    CUDA_VISIBLE_DEVICES=0 RPP_STAGE_PARAMS=0 RPP_GRAD_BUFFERS=1 bench --workload qwen3-8b --warmup 2 --iters 3 | tail -5 ;;
  8b1)  # issue 19: qwen3-8b 8 x 4096 on 1 GPU, default settings (TFLOP/s per GPU vs qwen3-4b's)
    CUDA_VISIBLE_DEVICES=0 bench --workload qwen3-8b --skip-baseline --warmup 2 --iters 3 | tail -4 ;;
  8b2)  # issue 6: qwen3-8b on 2 GPUs
    RPP_STAGE_PARAMS=0 RPP_GRAD_BUFFERS=1 bench --workload qwen3-8b --skip-baseline --warmup 2 --iters 3 | tail -4 ;;
  bound)  # issue 19: where 2 GPUs lose on qwen3-1.7b 16 x 4096: the GPU tests, 1 GPU, 2 GPUs default, the
    # pipeline without the optimizer step (--no-step), and the optimizer on fewer threads; each under a timeout
    [ -n "${SKIP_TESTS:-}" ] || timeout 230 python3 -m pytest -m gpu tests/test_gpu.py tests/test_loss.py -q -p no:cacheprovider 2>&1 | tee -a "$log" | tail -3
    W="--workload qwen3-1.7b --batch 16 --skip-baseline --warmup 3 --iters 4"
    CUDA_VISIBLE_DEVICES=0 tbench 80 $W | grep -E "^\| roundpipe|per-iteration|Error"
    tbench 70 $W | grep -E "^\| roundpipe|per-iteration|optimizer step|Error"
    tbench 70 $W --no-step | grep -E "^\| roundpipe|per-iteration|Error"
    RPP_OPTIM_THREADS=12 tbench 70 $W | grep -E "^\| roundpipe|per-iteration|optimizer step|Error" ;;
  peer)  # issue 19: activations GPU to GPU (RPP_DEBUG_PEER_HANDOFF=1) against through the host, and forward groups
    # of 1, 2, 4 layers (backward one layer per group): what the hand-overs between forward groups cost.
    # The first 2-GPU training run of a machine took over 70 s (37 s later): a short run takes that first.
    timeout 150 python3 -m pytest -m gpu tests/test_gpu.py -k "peer" -q -p no:cacheprovider 2>&1 | tee -a "$log" | tail -2
    W="--workload qwen3-1.7b --batch 16 --skip-baseline --warmup 3 --iters 4"
    tbench 150 $W --plan layerwise --warmup 1 --iters 1 | grep -E "load to|Error"
    CUDA_VISIBLE_DEVICES=0 tbench 80 $W | grep -E "^\| roundpipe|per-iteration|plan:|Error"
    for run in "0 layerwise" "1 layerwise" "0 fwd2" "0 fwd4" "1 fwd2" "1 fwd4" "0 layerwise"; do
      set -- $run
      echo "RPP_DEBUG_PEER_HANDOFF=$1 --plan $2" | tee -a "$log"
      RPP_DEBUG_PEER_HANDOFF=$1 tbench 60 $W --plan $2 | grep -E "^\| roundpipe|per-iteration|Error"
    done ;;
  opt)  # issue 19: does the host optimizer bound 2 GPUs (its memory traffic beside the uploads)? forward groups
    # of 2 layers: default (and where the threads spend two more iterations), without Adam (--noop-step)
    # on 2 GPUs and 1, 4 optimizer threads, 8 microbatches.
    W="--workload qwen3-1.7b --batch 16 --skip-baseline --warmup 3 --iters 4 --plan fwd2"
    tbench 120 $W --warmup 1 --iters 1 | grep -E "load to|Error"
    tbench 90 $W --sample-stacks | grep -E "^\| roundpipe|per-iteration|optimizer step|GIL|stacks of|%|Error"
    tbench 60 $W --noop-step | grep -E "^\| roundpipe|per-iteration|Error"
    CUDA_VISIBLE_DEVICES=0 tbench 80 $W --noop-step | grep -E "^\| roundpipe|per-iteration|Error"
    RPP_OPTIM_THREADS=4 tbench 60 $W | grep -E "^\| roundpipe|per-iteration|optimizer step|Error"
    tbench 60 $W --microbatches 8 | grep -E "^\| roundpipe|per-iteration|Error" ;;
  grads)  # issue 19: parameter gradients on their own stream (a hand-over no longer queues behind a layer's
    # gradient download or merge) and forward groups as long as the slowest backward group (auto plan):
    # the GPU tests; 2 GPUs (and where pinned blocks are created), 2 GPUs with RPP_GRAD_STREAM=0; 1 GPU
    # auto (one warm-up: also issue 22's first timed iteration) and one layer per group
    timeout 120 python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tee -a "$log" | tail -2
    W="--workload qwen3-1.7b --batch 16 --skip-baseline --warmup 3 --iters 4"
    tbench 120 $W --host-allocs | grep -E "^\| roundpipe|per-iteration|plan:|pinned|host allocs| x |Error"
    RPP_GRAD_STREAM=0 tbench 60 $W | grep -E "^\| roundpipe|per-iteration|Error"
    CUDA_VISIBLE_DEVICES=0 tbench 80 $W --warmup 1 --iters 5 | grep -E "^\| roundpipe|per-iteration|plan:|first timed|Error"
    CUDA_VISIBLE_DEVICES=0 tbench 70 $W --plan layerwise | grep -E "^\| roundpipe|per-iteration|Error" ;;
  ab)  # issue 19, side by side: one GPU, then 2 GPUs with parameter gradients on their own stream or
    # not (RPP_GRAD_STREAM 1/0) on the auto plan and on forward pairs (fwd2, last session's best), and
    # pinned blocks registered on 8 threads instead of cudaHostAlloc (first iterations, pinning time)
    W="--workload qwen3-1.7b --batch 16 --skip-baseline --warmup 3 --iters 4"
    P="^\\| roundpipe|per-iteration|plan:|pinned blocks|first timed|load to|Error"
    echo "1 GPU" | tee -a "$log"; CUDA_VISIBLE_DEVICES=0 tbench 95 $W | grep -E "$P"
    for a in "1 auto 100" "0 auto 75" "1 fwd2 75" "0 fwd2 75"; do
      set -- $a; echo "RPP_GRAD_STREAM=$1 --plan $2" | tee -a "$log"
      RPP_GRAD_STREAM=$1 tbench $3 $W --plan $2 | grep -E "$P"
    done
    echo "host register allocator" | tee -a "$log"
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 tbench 75 $W --warmup 1 | grep -E "$P" ;;
  threads)  # issue 19: does the host optimizer's thread count starve the two device threads while the step
    # runs? One GPU, then 2 GPUs at optimizer thread counts THREADS_RUNS ("N:time limit" each, N "default"
    # for the built-in default; WITH_TESTS=1: the GPU tests first)
    W="--workload qwen3-1.7b --batch 16 --skip-baseline --warmup 3 --iters 4"
    P="^\\| roundpipe|per-iteration|plan:|thread CPU|optimizer step|load to|Error"
    [ -n "${WITH_TESTS:-}" ] && timeout 200 python3 -m pytest -m gpu tests/test_gpu.py tests/test_loss.py -q -p no:cacheprovider 2>&1 | tee -a "$log" | tail -2
    python3 -c "import os, torch; print('cores', len(os.sched_getaffinity(0)), 'torch threads', torch.get_num_threads())" | tee -a "$log"
    echo "1 GPU" | tee -a "$log"; CUDA_VISIBLE_DEVICES=0 tbench 95 $W | grep -E "$P"
    for a in ${THREADS_RUNS:-default:100 12:75 20:75 default:75 8:75}; do
      n=${a%%:*}; limit=${a##*:}; echo "RPP_OPTIM_THREADS=$n" | tee -a "$log"
      if [ "$n" = default ]; then tbench "$limit" $W | grep -E "$P"; else RPP_OPTIM_THREADS=$n tbench "$limit" $W | grep -E "$P"; fi
    done ;;
  plans)  # issue 5 on 2 GPUs: auto plan vs one layer per group, idle time between groups
    RPP_PROFILER=torch bench --workload qwen3-1.7b --skip-baseline --compare-plans --profile --profile-iters 3 --warmup 3 --iters 4 | tail -20 ;;
  dp)  # issue 9: two ranks (one GPU each) vs one on qwen3-1.7b, and the loss curve vs one process
    # (DP_BATCH: sequences per rank, default 4; the reference process trains 2 x DP_BATCH)
    B=${DP_BATCH:-4}; A="--model qwen3-1.7b --seq 4096 --steps 20 --warmup 4"
    torchrun --standalone --nproc-per-node 1 bench/dp_bench.py $A --batch-per-rank $B --out "$out/one$B.json" 2>&1 | tail -3
    torchrun --standalone --nproc-per-node 1 bench/dp_bench.py $A --batch-per-rank $((2 * B)) --out "$out/ref$B.json" 2>&1 | tail -3
    torchrun --standalone --nproc-per-node 2 bench/dp_bench.py $A --batch-per-rank $B --out "$out/two$B.json" 2>&1 | tail -3
    python3 bench/dp_bench.py --compare "$out/one$B.json" "$out/two$B.json" --loss-ref "$out/ref$B.json" ;;
  numa)  # issue 19: data parallel 2 ranks x 8 on qwen3-1.7b with each rank bound to its GPU's NUMA node
    # (torchrun --numa-binding=node: the host Adam steps of the two ranks then stream from two memory
    # controllers instead of one), against unbound; the same 14 optimizer threads per rank; GPU tests first
    nvidia-smi topo -m 2>&1 | head -6; lscpu | grep -i -E "numa|socket|model name" | tee -a "$log"
    [ -n "${SKIP_TESTS:-}" ] || timeout 200 python3 -m pytest -m gpu tests/test_gpu.py tests/test_loss.py -q -p no:cacheprovider 2>&1 | tee -a "$log" | tail -3
    A="--model qwen3-1.7b --seq 4096 --steps 12 --warmup 3 --batch-per-rank 8"
    d() { timeout "$1" torchrun --standalone "${@:2}" 2>&1 | grep -v -i warn | tee -a "$log" | grep -E "tokens/s|s/iter|Error|error" | tail -3; }
    d 100 --nproc-per-node 1 bench/dp_bench.py $A --out "$out/one.json"
    d 110 --nproc-per-node 2 bench/dp_bench.py $A --threads 14 --out "$out/two.json"
    d 110 --numa-binding=node --nproc-per-node 2 bench/dp_bench.py $A --threads 14 --out "$out/two_numa.json"
    d 110 --nproc-per-node 2 bench/dp_bench.py $A --threads 16 --out "$out/two16.json" ;;
  shard)  # issue 19: data parallel 2 ranks x 8 on qwen3-1.7b with the host step shared by the two ranks
    # (--shard-optimizer) against replicated steps and one rank, 20 steps each; the loss curve against one
    # process on the 16-sequence batch; then the GPU tests (2-GPU ones included) in the time left
    grep -H . /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled | tee -a "$log"
    A="--model qwen3-1.7b --seq 4096 --steps 20 --warmup 4"
    d() { timeout "$1" torchrun --standalone "${@:2}" 2>&1 | grep -v -i warn | tee -a "$log" | grep -E "tokens/s|tok/s|Error|error" | tail -3; }
    d 140 --nproc-per-node 1 bench/dp_bench.py $A --batch-per-rank 8 --out "$out/one.json"
    d 120 --nproc-per-node 2 bench/dp_bench.py $A --batch-per-rank 8 --shard-optimizer --out "$out/sharded.json"
    d 110 --nproc-per-node 2 bench/dp_bench.py $A --batch-per-rank 8 --out "$out/two.json"
    python3 bench/dp_bench.py --compare "$out/one.json" "$out/two.json" 2>&1 | tee -a "$log" | tail -2
    python3 bench/dp_bench.py --compare "$out/one.json" "$out/sharded.json" 2>&1 | tee -a "$log" | tail -2
    d 100 --nproc-per-node 1 bench/dp_bench.py $A --batch-per-rank 16 --out "$out/ref.json"
    python3 bench/dp_bench.py --compare "$out/one.json" "$out/sharded.json" --loss-ref "$out/ref.json" 2>&1 | tee -a "$log" | tail -3
    [ -n "${SKIP_TESTS:-}" ] || timeout "${TESTS_S:-170}" python3 -m pytest -m gpu tests/test_gpu.py tests/test_loss.py -q -p no:cacheprovider 2>&1 | tee -a "$log" | tail -3 ;;
  *)
    echo "usage: bash bench/two_gpu_acceptance.sh tests|bound|peer|opt|grads|ab|threads|scale|4b|8b|8b1|8b2|plans|dp|numa|shard" >&2; exit 2 ;;
esac
