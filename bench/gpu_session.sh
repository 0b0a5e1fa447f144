#!/usr/bin/env bash
# GPU runs of this session's issues, one part per device call (see docs/benchmarks.md):
#   bash bench/gpu_session.sh refactor|context8b|context17b|capped|host|streamed|lora32|issue22|first|first2|first3|floor
# "refactor" compares the tree in .old/ (the commit before the restructuring, carried as a folder) with
# this one in one call; "context*" are the long-context rows of issue 21.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  export PATH=/tmp/site/bin:$PATH  # py-spy, when carried
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-.}
quiet() { grep -v -i "warn" | grep -v "^ *[0-9.]* ms at"; }
case "${1:-}" in
  refactor)
    nvidia-smi -L; free -g | head -2
    timeout 240 python3 -m pytest -m gpu tests/test_gpu.py tests/test_loss.py tests/test_tiling.py -q -p no:cacheprovider 2>&1 | tail -4
    for i in 1; do
      (cd .old && PYTHONPATH=$PWD:/tmp/site python3 bench/train_bench.py --workload qwen3-1.7b --skip-baseline --warmup 3 --iters 4 2>&1 | quiet | tail -2)
      python3 bench/train_bench.py --workload qwen3-1.7b --skip-baseline --warmup 3 --iters 4 2>&1 | quiet | tail -2
    done
    python3 bench/train_bench.py --workload qwen3-1.7b --batch 2 --seq 32768 --microbatches 2 --skip-baseline --compare-tiling --warmup 2 --iters 3 2>&1 | quiet | tail -4 ;;
  context8b)
    python3 bench/long_context.py --workload qwen3-8b --lora 16 --lengths 131072,262144 --skip-baseline --out "$out/context8b.json" 2>&1 | quiet | tail -8 ;;
  context17b)
    python3 bench/long_context.py --workload qwen3-1.7b --lengths 524288 --skip-baseline --out "$out/context17b.json" 2>&1 | quiet | tail -6 ;;
  capped)
    RPP_GPU_MEMORY=24GiB python3 bench/long_context.py --workload qwen3-1.7b --lengths 262144 --skip-baseline --out "$out/capped17b.json" 2>&1 | quiet | tail -5
    RPP_GPU_MEMORY=24GiB python3 bench/long_context.py --workload qwen3-8b --lora 16 --lengths 131072 --skip-baseline --out "$out/capped8b.json" 2>&1 | quiet | tail -5 ;;
  host)  # issue 22 (nvidia-h100-x1): first iteration after ONE warm-up, qwen3-4b's TFLOP/s, qwen3-8b with the
    # compact state (int8 moments, bf16 masters: must fit the 128 GiB host, GPU <= 12 GiB); whole logs in $out/host.log
    for a in "qwen3-1.7b --iters 6" "qwen3-4b --iters 4" "qwen3-8b --iters 4 --optim-state int8 --master bfloat16"; do
      python3 bench/train_bench.py --workload $a --skip-baseline --warmup 1 2>&1 | quiet | tee -a "$out/host.log" | grep -E "^\| roundpipe|first timed|load to"
    done ;;
  streamed)  # issue 22: RPP_STEP_MODE=streamed (two bf16 host buffers, no staleness) vs the default, same call
    for w in qwen3-1.7b qwen3-4b; do
      for mode in staged streamed; do
        RPP_STEP_MODE=$mode python3 bench/train_bench.py --workload $w --skip-baseline --warmup 3 --iters 4 2>&1 | quiet | tee -a "$out/streamed.log" | grep -E "^\| roundpipe|optimizer step"
      done
    done ;;
  lora32)  # issue 22: qwen3-32b LoRA r=16, 8 x 4096, one H100 (65 GB of bf16 weights on the host)
    python3 bench/train_bench.py --workload qwen3-32b --lora 16 --skip-baseline --warmup 1 --iters 2 2>&1 | quiet | tee -a "$out/lora32.log" | tail -4 ;;
  issue22)  # one H100 call for what the eleventh session changed without a GPU: the GPU tests, the first
    # timed iteration after ONE warm-up (join of the host-buffer thread, re-plan hysteresis, optimizer
    # threads), and qwen3-32b LoRA with the planner counting merged stages' weights; logs in $out/issue22.log.
    # A run cut by its limit gets SIGABRT, so Python's fault handler prints every thread's stack to the log.
    export PYTHONFAULTHANDLER=1
    timeout 160 python3 -m pytest -m gpu tests/test_gpu.py tests/test_loss.py -q -p no:cacheprovider 2>&1 | tee -a "$out/issue22.log" | tail -2
    for a in "120 qwen3-1.7b --iters 6" "300 qwen3-32b --lora 16 --iters 2"; do
      set -- $a; limit=$1; shift
      timeout -s ABRT "$limit" python3 bench/train_bench.py --workload "$@" --skip-baseline --warmup 1 2>&1 | quiet | tee -a "$out/issue22.log" | grep -E "^\| roundpipe|per-iteration|load to|Error|Fatal"
    done ;;
  first)  # issue 22: the first timed iteration after ONE warm-up is ~0.3 s slow on qwen3-1.7b; the auto plan
    # against a fixed one (--plan layerwise: never re-planned), each twice; logs in $out/first.log
    timeout 120 python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tee -a "$out/first.log" | tail -2
    for plan in auto layerwise auto layerwise; do
      timeout -s ABRT 90 python3 bench/train_bench.py --workload qwen3-1.7b --plan $plan --iters 6 --skip-baseline --warmup 1 2>&1 | quiet | tee -a "$out/first.log" | grep -E "^\| roundpipe|load to|pinned blocks|Error"
    done
    # Pinned blocks of torch's host allocator through malloc + cudaHostRegister on 8 threads instead of
    # cudaHostAlloc (which holds a driver lock the device threads wait for): pinning time, first iteration
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \
      timeout -s ABRT 90 python3 bench/train_bench.py --workload qwen3-1.7b --iters 6 --skip-baseline --warmup 1 2>&1 | quiet | tee -a "$out/first.log" | grep -E "^\| roundpipe|load to|pinned blocks|Error" ;;
  floor)  # issue 22: gradient downloads into the weights' buffers (RPP_GRAD_INTO_MODEL, default) against the
    # three-buffer rotation (=0), alternating, one warm-up (the first timed iteration too): host bytes/param and
    # tokens/s; qwen3-1.7b also against the GPU-resident Liger baseline (.whl carries liger-kernel)
    W="--warmup 1 --iters 6"
    P="^\\| |load to|per-iteration|optimizer step|Error"
    timeout -s ABRT 200 python3 bench/train_bench.py --workload qwen3-1.7b $W --baselines liger 2>&1 | quiet | tee -a "$out/floor.log" | grep -E "$P"
    for a in "0 qwen3-1.7b 80" "1 qwen3-1.7b 80" "0 qwen3-4b 110" "1 qwen3-4b 110"; do
      set -- $a; echo "RPP_GRAD_INTO_MODEL=$1 $2" | tee -a "$out/floor.log"
      RPP_GRAD_INTO_MODEL=$1 timeout -s ABRT $3 python3 bench/train_bench.py --workload $2 $W --skip-baseline 2>&1 | quiet | tee -a "$out/floor.log" | grep -E "$P"
    done ;;
  first3)  # issue 22: where the first timed iteration after ONE warm-up goes (the warm-up step, the training call
    # per iteration), downloads into the weights (default, nothing staged ahead) against RPP_GRAD_INTO_MODEL=0,
    # and with the step's Adam left out (--noop-step); then qwen3-4b, default
    P="^\\| roundpipe|plan:|load to|per-iteration|optimizer step|warm-up step|Error"
    for a in "1 qwen3-1.7b 90 -" "0 qwen3-1.7b 80 -" "1 qwen3-1.7b 80 --noop-step" "1 qwen3-1.7b 80 -" "1 qwen3-4b 110 -"; do
      set -- $a; x=$4; [ "$x" = - ] && x=""; echo "RPP_GRAD_INTO_MODEL=$1 $2 $x" | tee -a "$out/first3.log"
      RPP_GRAD_INTO_MODEL=$1 timeout -s ABRT $3 python3 bench/train_bench.py --workload $2 --warmup 1 --iters 6 --skip-baseline $x 2>&1 | quiet | tee -a "$out/first3.log" | grep -E "$P"
    done ;;
  first2)  # issue 22: what differs in the first timed iteration after ONE warm-up: per iteration the pinned
    # blocks, the GPU segments (cudaMalloc) and the cached plans (a re-plan after the warm-up?), auto plan
    # against a fixed one; then the compact step's speed against fp32 Adam on this host's cores
    for plan in auto layerwise auto layerwise; do
      timeout -s ABRT 90 python3 bench/train_bench.py --workload qwen3-1.7b --plan $plan --iters 6 --skip-baseline --warmup 1 2>&1 | quiet | tee -a "$out/first2.log" | grep -E "^\| roundpipe|load to|pinned blocks|GPU segments|plans after|per-iteration|optimizer step|Error"
    done
    timeout 150 python3 bench/compact_adam_bench.py --params 200M --threads 12 2>&1 | tee -a "$out/first2.log" | tail -12 ;;
  saved)  # issue 22 (nvidia-h100-x1), the final two-buffer runtime at ONE warm-up (the first timed iteration):
    # backward-stage inputs on the host (default) against kept on the GPU (RPP_DEBUG_DEVICE_SAVED_GB=16), host
    # bytes/param and tokens/s side by side, qwen3-1.7b and qwen3-4b; then qwen3-8b with the compact state
    # (int8 moments, bf16 masters). A short first run takes the fresh machine's slow first process.
    P="^\\| roundpipe|load to|per-iteration|host RSS growth|optimizer step|Error"
    timeout -s ABRT 90 python3 bench/train_bench.py --workload qwen3-1.7b --warmup 1 --iters 2 --skip-baseline 2>&1 | quiet | grep -E "load to|Error"
    for a in "0 qwen3-1.7b 6 70" "16 qwen3-1.7b 6 70" "0 qwen3-4b 4 90" "16 qwen3-4b 4 90" "0 qwen3-1.7b 6 70"; do
      set -- $a; echo "RPP_DEBUG_DEVICE_SAVED_GB=$1 $2" | tee -a "$out/saved.log"
      RPP_DEBUG_DEVICE_SAVED_GB=$1 timeout -s ABRT $4 python3 bench/train_bench.py --workload $2 --warmup 1 --iters $3 --skip-baseline 2>&1 | quiet | tee -a "$out/saved.log" | grep -E "$P"
    done
    timeout -s ABRT 200 python3 bench/train_bench.py --workload qwen3-8b --warmup 1 --iters 3 --skip-baseline --optim-state int8 --master bfloat16 2>&1 | quiet | tee -a "$out/saved.log" | grep -E "$P" ;;
  gaps)  # issue 22: the GPU's idle gaps in the first timed iteration after ONE warm-up against the third, with
    # the warm-up's step overlapping it (default) and after it ended (--pause-after-warmup 3); then qwen3-8b
    # compact again, four timed iterations (one 12.8 s iteration in the last call's three)
    P="^\\| roundpipe|load to|per-iteration|timed iteration|GPU 0|  .* ms at|Error"
    timeout -s ABRT 90 python3 bench/train_bench.py --workload qwen3-1.7b --warmup 1 --iters 2 --skip-baseline 2>&1 | quiet | grep -E "load to|Error"
    for x in "" "--pause-after-warmup 3"; do
      echo "qwen3-1.7b $x" | tee -a "$out/gaps.log"
      timeout -s ABRT 80 python3 bench/train_bench.py --workload qwen3-1.7b --warmup 1 --iters 5 --skip-baseline --profile-timed 1,3 $x 2>&1 | quiet | tee -a "$out/gaps.log" | grep -E "$P"
    done
    timeout -s ABRT 220 python3 bench/train_bench.py --workload qwen3-8b --warmup 1 --iters 4 --skip-baseline --optim-state int8 --master bfloat16 2>&1 | quiet | tee -a "$out/gaps.log" | grep -E "^\\| roundpipe|load to|per-iteration|optimizer step|warm-up step|host RSS growth|Error" ;;
  gaps2)  # issue 22: the gap lines "gaps" filtered out: GPU-only, then per layer group (RPP_PROFILER=torch)
    timeout -s ABRT 90 python3 bench/train_bench.py --workload qwen3-1.7b --warmup 1 --iters 2 --skip-baseline 2>&1 | quiet | grep -E "load to|Error"
    for pr in "" torch; do
      echo "RPP_PROFILER=$pr" | tee -a "$out/gaps2.log"
      RPP_PROFILER=$pr timeout -s ABRT 80 python3 bench/train_bench.py --workload qwen3-1.7b --warmup 1 --iters 3 --skip-baseline --profile-timed 1,3 2>&1 | grep -v -i warn | tee -a "$out/gaps2.log" | grep -E "timed iteration|GPU 0| ms at|idle|between|Error" | head -40
    done ;;
  auto)  # issue 22 (nvidia-h100-x1): backward-stage inputs kept in the GPU memory the plan leaves free by default
    # (RPP_DEBUG_DEVICE_SAVED_GB=auto) against the host copies (=0), one warm-up each: host bytes/param, tokens/s,
    # the first timed iteration; the GPU tests first (also the machine's first process). Last, where the first
    # timed iteration waits: the runtime threads' blocking waits (--wait-log) and the GPU's idle gaps.
    timeout 300 python3 -m pytest -m gpu tests/test_gpu.py tests/test_loss.py -q -p no:cacheprovider 2>&1 | tee -a "$out/auto.log" | tail -2
    P="^\\| roundpipe|load to|per-iteration|host RSS growth|Error"
    for a in "auto qwen3-1.7b 5 60" "0 qwen3-1.7b 5 60" "auto qwen3-4b 3 75" "0 qwen3-4b 3 75"; do
      set -- $a; echo "RPP_DEBUG_DEVICE_SAVED_GB=$1 $2" | tee -a "$out/auto.log"
      RPP_DEBUG_DEVICE_SAVED_GB=$1 timeout -s ABRT $4 python3 bench/train_bench.py --workload $2 --warmup 1 --iters $3 --skip-baseline 2>&1 | quiet | tee -a "$out/auto.log" | grep -E "$P"
    done
    timeout -s ABRT 60 python3 bench/train_bench.py --workload qwen3-1.7b --warmup 1 --iters 3 --skip-baseline --wait-log --profile-timed 1,3 2>&1 | grep -v -i warn \
      | tee -a "$out/auto.log" | grep -E "^waits|timed iteration|GPU 0|copies| ms at| ms from|Error" | head -70 ;;
  auto2)  # issue 22 (nvidia-h100-x1), seventeenth session: a warm-up process first (a fresh machine's first process
    # compiles and ran past the limits of "auto"), then RPP_DEBUG_DEVICE_SAVED_GB 0 vs auto side by side, then what each
    # thread runs, 20 ms by 20 ms, in the first timed iteration (the gap at the forward-to-backward turn).
    timeout -s ABRT 200 python3 bench/train_bench.py --workload qwen3-1.7b --warmup 1 --iters 2 --skip-baseline 2>&1 | tail -3 | tee -a "$out/auto2.log"
    P="^\\| roundpipe|load to|per-iteration|host RSS growth|garbage|Error"
    for a in "0 qwen3-1.7b 5 100" "auto qwen3-1.7b 5 100" "0 qwen3-4b 3 130" "auto qwen3-4b 3 130"; do
      set -- $a; echo "RPP_DEBUG_DEVICE_SAVED_GB=$1 $2" | tee -a "$out/auto2.log"
      RPP_DEBUG_DEVICE_SAVED_GB=$1 timeout -s ABRT $4 python3 bench/train_bench.py --workload $2 --warmup 1 --iters $3 --skip-baseline 2>&1 | quiet | tee -a "$out/auto2.log" | grep -E "$P"
    done
    timeout -s ABRT 100 python3 bench/train_bench.py --workload qwen3-1.7b --warmup 1 --iters 3 --skip-baseline --stack-timeline 1 > "$out/timeline.log" 2>&1
    grep -E "per-iteration|load to|garbage" "$out/timeline.log" ;;
  first4)  # issue 22 (nvidia-h100-x1), seventeenth session: the first timed iteration after one warm-up with a tied
    # weight's buffers built in the background (the pinning of its staging buffer held up the first iteration's
    # backward); a warm-up process first; then the timeline again (no cudaHostRegister beside the iteration).
    timeout -s ABRT 200 python3 bench/train_bench.py --workload qwen3-1.7b --warmup 1 --iters 2 --skip-baseline 2>&1 | tail -3 | tee -a "$out/first4.log"
    P="^\\| roundpipe|load to|per-iteration|host RSS growth|garbage|Error"
    for a in "qwen3-1.7b 5 100" "qwen3-4b 4 140" "qwen3-1.7b 5 100"; do
      set -- $a; echo "$1" | tee -a "$out/first4.log"
      timeout -s ABRT $3 python3 bench/train_bench.py --workload $1 --warmup 1 --iters $2 --skip-baseline 2>&1 | quiet | tee -a "$out/first4.log" | grep -E "$P"
    done
    timeout -s ABRT 100 python3 bench/train_bench.py --workload qwen3-1.7b --warmup 1 --iters 3 --skip-baseline --stack-timeline 1 > "$out/timeline.log" 2>&1
    grep -E "per-iteration|load to|garbage" "$out/timeline.log"; grep -c "_cuda_register" "$out/timeline.log" ;;
  tied)  # issue 22 (nvidia-h100-x1), seventeenth session, final runtime: a tied weight's two rotating host buffers
    # (bytes/param) and the first timed iteration, a warm-up process first; then the GPU tests.
    timeout -s ABRT 200 python3 bench/train_bench.py --workload qwen3-1.7b --warmup 1 --iters 2 --skip-baseline 2>&1 | tail -3 | tee -a "$out/tied.log"
    P="^\\| roundpipe|load to|per-iteration|host RSS growth|Error"
    for a in "qwen3-1.7b 5 100" "qwen3-4b 4 140"; do
      set -- $a; echo "$1" | tee -a "$out/tied.log"
      timeout -s ABRT $3 python3 bench/train_bench.py --workload $1 --warmup 1 --iters $2 --skip-baseline 2>&1 | quiet | tee -a "$out/tied.log" | grep -E "$P"
    done
    timeout 230 python3 -m pytest -m gpu tests/test_gpu.py tests/test_loss.py -q -p no:cacheprovider 2>&1 | tee -a "$out/tied.log" | tail -2 ;;
  liger4b)  # issue 22's last row (nvidia-h100-x1, carry [".whl"]): qwen3-4b against the GPU-resident Liger baseline in
    # one process (a 1.7b warm-up process first), then the GPU busy fraction of a steady 4b iteration.
    timeout -s ABRT 200 python3 bench/train_bench.py --workload qwen3-1.7b --warmup 1 --iters 2 --skip-baseline 2>&1 | tail -1 | tee -a "$out/liger4b.log"
    timeout -s ABRT 300 python3 bench/train_bench.py --workload qwen3-4b --warmup 1 --iters 4 --baselines liger 2>&1 | quiet | tee -a "$out/liger4b.log" | grep -E "^\\||per-iteration|host RSS|Error"
    timeout -s ABRT 100 python3 bench/train_bench.py --workload qwen3-4b --warmup 1 --iters 3 --skip-baseline --profile-timed 3 2>&1 | tee -a "$out/liger4b.log" | grep -E "timed iteration|GPU 0|Error" ;;
  user)  # issues 36/37/40 (nvidia-h100-x1, carry [".whl", ".old"]), twenty-first session: the bench beside the
    # GPU-resident Liger baseline in one process, the tree before the restructuring (.old = 42ce6e4), and a
    # user's plain script (bench/user_script.py), qwen3-1.7b then qwen3-4b, 8 x 4096; logs in $out/user.log
    nvidia-smi -L
    for w in qwen3-1.7b qwen3-4b; do
      timeout -s ABRT 200 python3 bench/train_bench.py --workload $w --warmup 3 --iters 4 --baselines liger 2>&1 | quiet | tee -a "$out/user.log" | grep -E "^\\||per-iteration|Error"
      timeout -s ABRT 100 python3 bench/user_script.py --workload $w --batch 8 2>&1 | tee -a "$out/user.log" | grep -E "user script|Error"
      (cd .old && PYTHONPATH=$PWD:/tmp/site timeout -s ABRT 100 python3 bench/train_bench.py --workload $w --skip-baseline --warmup 3 --iters 4 2>&1 | quiet | tee -a "$out/user.log" | grep -E "^\\| roundpipe|Error")
    done ;;
  seqtiles)  # issue 38 (nvidia-h100-x2 / h200-x2), for the twenty-second session: the GPU tests of the tiles (both
    # tile attentions), what fails with roundpipe's expandable segments on 2 GPUs ("operation not permitted" on
    # cuda:1 in the twenty-first session: the C++ stack names the call), then qwen3-8b LoRA in 8 tiles on 2 GPUs
    # against the unsplit sequence on 1, both tile attentions, 2 timed iterations (the first long iteration pins
    # the keys' and values' host blocks); logs in $out/seqtiles.log
    export PYTHONFAULTHANDLER=1
    timeout 200 python3 -m pytest -m gpu tests/test_gpu.py -k "sequence or cached" -q -p no:cacheprovider 2>&1 | tee -a "$out/seqtiles.log" | tail -3
    TORCH_SHOW_CPP_STACKTRACES=1 timeout -s ABRT 120 python3 bench/pool_bench.py --workload qwen3-1.7b --batch 1 --seq 16384 --devices 2 --graphs 0 --sequence-tiles 4 --warmup 1 --iters 1 2>&1 | tee -a "$out/seqtiles.log" | grep -E "tokens/s|Error|error" | head -5
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
    for a in "${SEQ:-65536} 2,1 bias" "${SEQ:-65536} 2 split"; do
      set -- $a
      RPP_DEBUG_TILE_ATTENTION=$3 timeout -s ABRT 280 python3 bench/pool_bench.py --workload qwen3-8b --lora 16 --batch 1 --seq $1 --devices $2 --graphs 0 --sequence-tiles 8 --warmup 1 --warmup-seq 8192 --iters 2 --busy --json "$out/seqtiles.json" 2>&1 | tee -a "$out/seqtiles.log" | grep -E "tokens/s|plan|Error"
    done ;;
  gcfreeze)  # issues 36/37 (nvidia-h100-x1 or nvidia-h200), for the twenty-third session: the GPU tests with
    # RPP_GC_FREEZE=1 (one graph-capture test failed with it in the twenty-second session: the whole output this
    # time), then the bench and the user script with and without it; logs in $out/gcfreeze.log
    RPP_GC_FREEZE=1 timeout 200 python3 -m pytest -m gpu tests/test_gpu.py -k "graphed or qwen3_0_6b" -q -p no:cacheprovider 2>&1 | tee -a "$out/gcfreeze.log" | grep -E "Error|assert|passed|failed" | head -20
    for w in qwen3-1.7b qwen3-4b; do
      for f in 0 1; do
        RPP_GC_FREEZE=$f timeout -s ABRT 100 python3 bench/train_bench.py --workload $w --skip-baseline --warmup 3 --iters 6 2>&1 | quiet | tee -a "$out/gcfreeze.log" | grep -E "^\\| roundpipe|per-iteration|garbage|Error" | sed "s/^/freeze=$f /"
        RPP_GC_FREEZE=$f timeout -s ABRT 150 python3 bench/user_script.py --workload $w --batch 8 2>&1 | grep -E "user script|Error" | sed "s/^/freeze=$f /"
      done
    done ;;
  x4a)  # issues 36/39/40 (nvidia-h200-x4), twenty-third session, call 1: the topology, every GPU test (the
    # multi-GPU ones included), then qwen3-1.7b 16 x 4096 on 1, 2 and 4 GPUs of one process (graphs on), each
    # GPU's busy share; logs in $out/x4a.log, rows in $out/rows.jsonl
    nvidia-smi topo -m | tee -a "$out/x4a.log"; nproc; free -g | head -2
    timeout 240 python3 -m pytest -m gpu tests -q -p no:cacheprovider 2>&1 | tee -a "$out/x4a.log" | grep -E "Error|assert|passed|failed" | head -20
    timeout -s ABRT 330 python3 bench/pool_bench.py --workload qwen3-1.7b --batch 16 --devices 1,2,4 --graphs 1 --busy --json "$out/rows.jsonl" 2>&1 | quiet | tee -a "$out/x4a.log" | grep -v "^ *$" | tail -20 ;;
  x4b)  # issues 36/37/39 (nvidia-h200-x4), twenty-third session, call 2: the Trainer GPU test that failed on 4 GPUs
    # (whole output), then where 4 GPUs lose time on qwen3-1.7b 16 x 4096: the threads' waits and a GPU-only trace
    # of one iteration, the pipeline without the optimizer, more optimizer threads, 16 microbatches
    timeout 90 python3 -m pytest -m gpu tests/test_integrations.py -q -p no:cacheprovider -x 2>&1 | tee "$out/trainer.log" | tail -40
    b="python3 bench/train_bench.py --workload qwen3-1.7b --batch 16 --skip-baseline --warmup 3 --iters 3"
    timeout -s ABRT 190 $b --wait-log --profile --trace "$out/trace4.json.gz" --trace-gpu-only 2>&1 | quiet | tee "$out/wait.log" | grep -E "^\\| roundpipe|per-iteration|simulated|waits|wait |GPU|Error" | head -60
    timeout -s ABRT 100 $b --no-step 2>&1 | quiet | tee "$out/nostep.log" | grep -E "^\\| roundpipe|per-iteration|Error"
    RPP_OPTIM_THREADS=48 timeout -s ABRT 100 $b 2>&1 | quiet | tee "$out/threads48.log" | grep -E "^\\| roundpipe|per-iteration|Error"
    timeout -s ABRT 100 $b --microbatches 16 2>&1 | quiet | tee "$out/mb16.log" | grep -E "^\\| roundpipe|per-iteration|simulated|Error" ;;
  x4c)  # issues 36/37/39 (nvidia-h200-x4, carry [".whl"]: py-spy), twenty-third session, call 3: the Trainer GPU
    # test's losses, the allocator race fixed; qwen3-1.7b 16 x 4096 on 4 GPUs: the interpreter lock's holders
    # (py-spy --gil), the pipeline without the optimizer, peer hand-overs, 16 microbatches
    timeout 60 python3 -m pytest -m gpu tests/test_integrations.py -q -p no:cacheprovider -x 2>&1 | tee "$out/trainer.log" | grep -E "^E |passed|failed" | head -8
    timeout -s ABRT 110 python3 bench/pool_bench.py --workload qwen3-1.7b --batch 16 --devices 4 --graphs 1 --busy --gil-sampler --json "$out/rows.jsonl" 2>&1 | quiet | tee "$out/gil.log" | grep -v "^ *$" | tail -8
    b="python3 bench/train_bench.py --workload qwen3-1.7b --batch 16 --skip-baseline --warmup 3 --iters 3"
    timeout -s ABRT 90 $b --no-step 2>&1 | quiet | tee "$out/nostep.log" | grep -E "^\\| roundpipe|per-iteration|Error"
    RPP_DEBUG_PEER_HANDOFF=1 timeout -s ABRT 90 $b 2>&1 | quiet | tee "$out/peer.log" | grep -E "^\\| roundpipe|per-iteration|Error"
    timeout -s ABRT 90 $b --microbatches 16 2>&1 | quiet | tee "$out/mb16.log" | grep -E "^\\| roundpipe|per-iteration|simulated|Error" ;;
  x4d)  # issues 36/39 (nvidia-h200-x4), twenty-third session, call 4: is a 4-GPU run repeatable (the Trainer test's
    # losses differed between runs), then qwen3-1.7b 16 x 4096 in one process per pool: 4 GPUs with peer hand-overs
    # (RPP_DEBUG_PEER_HANDOFF=auto's new default there) and without, 1 GPU, 2 GPUs; logs in $out
    timeout 50 python3 bench/repeat_losses.py 2>&1 | tee "$out/repeat.log" | grep -E "device|Error"
    CUDA_VISIBLE_DEVICES=0 timeout 40 python3 bench/repeat_losses.py 2>&1 | tee -a "$out/repeat.log" | grep -E "device|Error"
    b="python3 bench/train_bench.py --workload qwen3-1.7b --batch 16 --skip-baseline --warmup 3 --iters 3"
    for v in "0,1,2,3 auto" "0,1,2,3 0" "0 auto" "0,1 auto"; do
      set -- $v
      CUDA_VISIBLE_DEVICES=$1 RPP_DEBUG_PEER_HANDOFF=$2 timeout -s ABRT 90 $b 2>&1 | quiet | tee "$out/b$1-$2.log" | grep -E "^\\| roundpipe|per-iteration|Error" | sed "s/^/gpus=$1 peer=$2 /"
    done ;;
  next1)  # any kind, first call of the twenty-fourth session: every GPU test on the final tree, each result named
    # (-rA), with room for a fresh machine's compiles; log in $out/gputests.log
    export PYTHONFAULTHANDLER=1
    timeout -s ABRT 540 python3 -m pytest -m gpu tests -q -rA -p no:cacheprovider 2>&1 | tee "$out/gputests.log" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^E " | head -60 ;;
  next4)  # issues 36/39 (nvidia-h200-x4 or h100-x4), twenty-fourth session: is a 4-GPU run repeatable (it also fills
    # the compile cache), then qwen3-1.7b 16 x 4096 in one process per pool, one call: 4 GPUs (peer hand-overs
    # on by auto) and 1 GPU first, then 4 GPUs without peer hand-overs and 2 GPUs; logs in $out (no commas in names)
    export PYTHONFAULTHANDLER=1
    timeout -s ABRT 150 python3 bench/repeat_losses.py 2>&1 | tee "$out/repeat4.log" | grep -E "device|Error"
    RPP_DEBUG_GRAPHS=0 timeout -s ABRT 90 python3 bench/repeat_losses.py 2>&1 | tee -a "$out/repeat4.log" | grep -E "device|Error" | sed "s/^/graphs=0 /"
    b="python3 bench/train_bench.py --workload qwen3-1.7b --batch 16 --skip-baseline --warmup 3 --iters 4"
    for v in "0,1,2,3 auto 4auto 200" "0 auto 1 120" "0,1,2,3 0 4nopeer 110" "0,1 auto 2auto 110"; do
      set -- $v
      CUDA_VISIBLE_DEVICES=$1 RPP_DEBUG_PEER_HANDOFF=$2 timeout -s ABRT $4 $b 2>&1 | quiet | tee "$out/g$3.log" | grep -E "^\\| roundpipe|per-iteration|Error" | sed "s/^/gpus=$1 peer=$2 /"
    done ;;
  next4b)  # issue 39 run 2 (a 4-GPU kind), after next4 on the same warm machine: qwen3-1.7b 32 x 4096 and
    # qwen3-4b 16 x 4096, 4 GPUs against 1 in one call, one process per pool; W=qwen3-4b B=16 to pick one
    export PYTHONFAULTHANDLER=1
    b="python3 bench/train_bench.py --workload ${W:-qwen3-1.7b} --batch ${B:-32} --skip-baseline --warmup 3 --iters 3"
    for v in "0,1,2,3 4 240" "0 1 200"; do
      set -- $v
      CUDA_VISIBLE_DEVICES=$1 timeout -s ABRT $3 $b 2>&1 | quiet | tee "$out/w$2.log" | grep -E "^\\| roundpipe|per-iteration|Error" | sed "s/^/${W:-qwen3-1.7b} ${B:-32}x4096 gpus=$1 /"
    done ;;
  s24a)  # issues 37/40 (any one-GPU kind, carry [".whl", ".old"]), twenty-fourth session, call 1: qwen3-1.7b 8 x 4096,
    # the bench (this tree, then .old = 42ce6e4, then this tree again) beside the user script three ways (as a user
    # writes it, the model built on the host, a GPU wait after each step), then every GPU test; logs in $out
    export PYTHONFAULTHANDLER=1
    nvidia-smi -L
    b="bench/train_bench.py --workload qwen3-1.7b --skip-baseline --warmup 3 --iters 6"
    timeout -s ABRT 100 python3 $b 2>&1 | quiet | tee "$out/bench1.log" | grep -E "^\\| roundpipe|per-iteration|optimizer step|Error"
    (cd .old && PYTHONPATH=$PWD:/tmp/site timeout -s ABRT 90 python3 $b 2>&1 | quiet | tee "$out/old.log" | grep -E "^\\| roundpipe|Error")
    for a in "" "--build host" "--sync-each"; do
      timeout -s ABRT 80 python3 bench/user_script.py --workload qwen3-1.7b --batch 8 $a 2>&1 | tee -a "$out/script.log" | grep -E "user script|step returns|Error" | sed "s/^/[$a] /"
    done
    timeout -s ABRT 90 python3 $b 2>&1 | quiet | tee "$out/bench2.log" | grep -E "^\\| roundpipe|per-iteration|optimizer step|Error"
    timeout -s ABRT 260 python3 -m pytest -m gpu tests -q -rA -p no:cacheprovider 2>&1 | tee "$out/gputests.log" | grep -E "^(FAILED|ERROR)|passed|failed|^E " | head -30 ;;
  s25a)  # issue 36: the pinned-block hazard of graph captures (torch alone, then HostScalar); the GPU tests;
    # the graph tests with RPP_GC_FREEZE=1 twice (it was kept off after a graph test failed with it)
    nvidia-smi -L
    python3 bench/capture_pinned_check.py 2>&1 | tee "$out/capture.log"
    timeout -s ABRT 300 python3 -m pytest -m gpu tests -q -rA -p no:cacheprovider 2>&1 | tee "$out/gputests.log" | grep -E "^(FAILED|ERROR)|passed|failed|^E " | head -30
    for i in 1 2; do
      RPP_GC_FREEZE=1 timeout -s ABRT 120 python3 -m pytest -m gpu tests/test_gpu.py tests/test_gc_freeze.py -q -p no:cacheprovider -k "graph or scalar or freeze" 2>&1 | tee -a "$out/freeze.log" | grep -E "^(FAILED|ERROR)|passed|failed|^E " | head -10
    done ;;
  s25b)  # issue 37 part 2: qwen3-8b LoRA 131,072 under a 24 GiB cap, with the memory detail; the plan beside it
    python3 -m roundpipe plan --model qwen3-8b --seq-len 131072 --lora-r 16 --gpu-memory 24GiB 2>&1 | grep "peak GPU"
    RPP_GPU_MEMORY=24GiB timeout -s ABRT 500 python3 bench/long_context.py --workload qwen3-8b --lora 16 --lengths 131072 --skip-baseline --memory-detail --out "$out/capped8b.json" 2>&1 | quiet | tee "$out/capped8b.log" | grep -v "^ *$" | tail -14 ;;
  s25c)  # issue 37 part 2: what fills the GPU at the peak of a qwen3-8b LoRA step at 131,072 (a 2-layer slice, as capped)
    RPP_GPU_MEMORY=24GiB RPP_DEBUG_DEVICE_SAVED_GB=0 timeout -s ABRT 400 python3 bench/memory_trace.py --workload qwen3-8b --lora 16 --layers 2 --seq 131072 --top 24 2>&1 | quiet | tee "$out/trace.log" | tail -32 ;;
  s25d)  # issue 38 on one GPU: what 8 tiles of one sequence cost beside the whole sequence, both tile attentions
    timeout -s ABRT 560 python3 bench/pool_bench.py --workload qwen3-8b --lora 16 --batch 1 --seq ${SEQ:-65536} --devices 1 --graphs 0 --sequence-tiles 8 --tile-modes none,split,bias --warmup 1 --iters 2 --json "$out/tiles1.json" 2>&1 | quiet | tee "$out/tiles1.log" | grep -E "tokens/s|plan|Error|error" ;;
  s25e)  # issue 38 on one GPU: the kernels of 8 tiles against the whole sequence (a 4-layer qwen3-8b LoRA slice, 65,536)
    TORCH_LOGS=recompiles timeout -s ABRT 300 python3 bench/tile_profile.py --workload qwen3-8b --lora 16 --layers 4 --seq ${SEQ:-65536} --tiles 8 --top 16 > "$out/tileprof.log" 2>&1
    grep -v -i "warn\|USDT" "$out/tileprof.log" | grep -E "^==|^\|" | head -40; grep -c -i "recompil" "$out/tileprof.log"; grep -i "recompil" "$out/tileprof.log" | head -5 ;;
  s25f)  # issue 38 on one GPU: the tiles' GPU tests, then s25e's profile on a 2-layer slice (run with
    # f5a81e5's cuDNN blocks checked out: roundpipe/runtime/tile_attention.py)
    timeout -s ABRT 80 python3 -m pytest -m gpu tests/test_gpu.py -k "sequence and cuda:0-" -q -rA -p no:cacheprovider 2>&1 | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|^E |worst" | head -12
    timeout -s ABRT 110 python3 bench/tile_profile.py --workload qwen3-8b --lora 16 --layers 2 --seq ${SEQ:-65536} --tiles 8 --top 4 --modes split > "$out/tileprof.log" 2>&1
    grep -v -i "warn\|USDT" "$out/tileprof.log" | grep -E "^==|^\||Error" | head -40 ;;
  s26a)  # issues 38/37/40 (one GPU, carry [".whl", ".old"]), twenty-sixth session, call 1: f5a81e5's cuDNN tile blocks
    # (checked out into roundpipe/runtime/tile_attention.py): the tiles' GPU tests and a 2-layer profile; then the bench
    # (this tree, .old = 42ce6e4) and the user script with its final synchronize split in two
    export PYTHONFAULTHANDLER=1
    nvidia-smi -L
    timeout -s ABRT 90 python3 -m pytest -m gpu tests/test_gpu.py -k "sequence and cuda:0-" -q -rA -p no:cacheprovider 2>&1 | tee "$out/seqtests.log" | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|^E |worst|cudnn" | head -14
    timeout -s ABRT 110 python3 bench/tile_profile.py --workload qwen3-8b --lora 16 --layers 2 --seq ${SEQ:-65536} --tiles 8 --top 4 --modes split > "$out/tileprof.log" 2>&1
    grep -v -i "warn\|USDT" "$out/tileprof.log" | grep -E "^==|^\||Error" | head -30
    b="bench/train_bench.py --workload qwen3-1.7b --skip-baseline --warmup 3 --iters 6"
    timeout -s ABRT 100 python3 $b 2>&1 | quiet | tee "$out/bench1.log" | grep -E "^\\| roundpipe|per-iteration|optimizer step|Error"
    (cd .old && PYTHONPATH=$PWD:/tmp/site timeout -s ABRT 90 python3 $b 2>&1 | quiet | tee "$out/old.log" | grep -E "^\\| roundpipe|Error")
    timeout -s ABRT 80 python3 bench/user_script.py --workload qwen3-1.7b --batch 8 2>&1 | tee "$out/script.log" | grep -E "user script|step returns|Error" ;;
  s26b)  # issue 38 on one GPU, twenty-sixth session, call 2: s25d again with the cuDNN blocks and auto splitting on them
    timeout -s ABRT 560 python3 bench/pool_bench.py --workload qwen3-8b --lora 16 --batch 1 --seq ${SEQ:-65536} --devices 1 --graphs 0 --sequence-tiles 8 --tile-modes none,auto --warmup 1 --iters 2 --json "$out/tiles1.json" 2>&1 | quiet | tee "$out/tiles1.log" | grep -E "tokens/s|plan|Error|error" ;;
  s26c)  # issue 38 part 2 on one GPU, twenty-sixth session, call 4: a 4-layer qwen3-8b LoRA slice at 524,288 tokens under
    # an 80 GiB cap with fp8 stage inputs (the full depth's plan beside it); then fp8 against bf16 stage inputs at 32K
    python3 -m roundpipe plan --model qwen3-8b --seq-len 524288 --lora-r 16 --gpu-memory 80GiB --host-memory 128GiB --stage-inputs fp8 2>&1 | tail -6
    RPP_GPU_MEMORY=80GiB RPP_STAGE_INPUTS=fp8 timeout -s ABRT 330 python3 bench/long_context.py --workload qwen3-8b --lora 16 --layers 4 --lengths 524288 --skip-baseline --memory-detail --out "$out/slice512k.json" 2>&1 | quiet | tee "$out/slice512k.log" | grep -v "^ *$" | tail -12
    timeout -s ABRT 200 python3 bench/stage_inputs_bench.py --grad-cosine --workload qwen3-8b --lora 16 --seq 32768 2>&1 | quiet | tee "$out/fp8cos.log" | tail -4 ;;
  s27x2a)  # issue 38 (a two-GPU kind), for the next session, call 1: every GPU test (the two-GPU ones, the tiles on cuDNN,
    # the compact codecs), then qwen3-8b LoRA 65,536: the whole sequence on 1 GPU beside 8 tiles on 2 (auto: cuDNN blocks)
    export PYTHONFAULTHANDLER=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
    nvidia-smi -L
    timeout -s ABRT 300 python3 -m pytest -m gpu tests -q -rA -p no:cacheprovider 2>&1 | tee "$out/gputests.log" | grep -E "^(FAILED|ERROR)|passed|failed|^E |worst" | head -20
    timeout -s ABRT 280 python3 bench/pool_bench.py --workload qwen3-8b --lora 16 --batch 1 --seq ${SEQ:-65536} --devices 2,1 --graphs 0 --sequence-tiles 8 --warmup 1 --warmup-seq 8192 --iters 2 --json "$out/tiles2.json" 2>&1 | quiet | tee "$out/tiles2.log" | grep -E "tokens/s|Error|error" ;;
  s27x2b)  # issue 38's first target row (a two-GPU kind), call 2: qwen3-8b LoRA 262,144, 8 tiles on 2 GPUs, then the whole
    # sequence on 1, one timed step each after a warm-up on 8,192 tokens (a 1-GPU step is ~230 s)
    export PYTHONFAULTHANDLER=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
    timeout -s ABRT 560 python3 bench/pool_bench.py --workload qwen3-8b --lora 16 --batch 1 --seq 262144 --devices 2,1 --graphs 0 --sequence-tiles 8 --warmup 1 --warmup-seq 8192 --iters 1 --json "$out/tiles262k.json" 2>&1 | quiet | tee "$out/tiles262k.log" | grep -E "tokens/s|Error|error" ;;
  s27a)  # issue 38 on one GPU, twenty-seventh session, call 1: the compact codecs' and the tiles' GPU tests; then full-depth
    # qwen3-8b LoRA at 262,144 under an 80 GiB cap with int8 stage inputs, to check the memory model that predicts 524,288
    export PYTHONFAULTHANDLER=1
    nvidia-smi -L
    timeout -s ABRT 100 python3 -m pytest -m gpu tests/test_gpu.py -k "compact or sequence" -q -rA -p no:cacheprovider 2>&1 | tee "$out/tests.log" | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|^E " | head -16
    for n in 262144 524288; do
      python3 -m roundpipe plan --model qwen3-8b --seq-len $n --lora-r 16 --gpu-memory 80GiB --host-memory 128GiB --stage-inputs int8 2>&1 | tail -4
    done
    RPP_GPU_MEMORY=80GiB RPP_STAGE_INPUTS=int8 timeout -s ABRT 440 python3 bench/long_context.py --workload qwen3-8b --lora 16 --lengths 262144 --warmup-len 8192 --skip-baseline --memory-detail --out "$out/full262k.json" 2>&1 | quiet | tee "$out/full262k.log" | grep -v "^ *$" | tail -14 ;;
  s27b)  # issues 38/37 on one GPU, twenty-seventh session, call 2: the compact codecs' GPU test after the division fix;
    # what a finished call still holds on the GPU when the next one plans (a 2-layer qwen3-8b LoRA slice, 65,536);
    # the user script with the optimizer on all 16 cores (its final synchronize is one unhidden step)
    export PYTHONFAULTHANDLER=1
    timeout -s ABRT 60 python3 -m pytest -m gpu tests/test_gpu.py -k compact -q -rA -p no:cacheprovider 2>&1 | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|^E " | head -8
    RPP_GPU_MEMORY=80GiB timeout -s ABRT 150 python3 bench/stale_memory_check.py --workload qwen3-8b --lora 16 --layers 2 --seq 65536 --calls 3 2>&1 | grep -E "^call|^  |kept|Error" | tee "$out/stale.log"
    for t in default 16; do
      (if [ $t != default ]; then export RPP_OPTIM_THREADS=$t; fi
       timeout -s ABRT 90 python3 bench/user_script.py --workload qwen3-1.7b --batch 8 2>&1 | tee "$out/script_$t.log" | grep -E "user script|step returns|Error")
    done ;;
  s27c)  # issues 36/38 on one GPU, twenty-seventh session, call 3: the GPU tests after the planner's flush of finished
    # jobs' tensors and the CPU workers' thread count; then what a finished call leaves again (the capacity read by each plan)
    export PYTHONFAULTHANDLER=1
    timeout -s ABRT 330 python3 -m pytest -m gpu tests -q -rA -p no:cacheprovider 2>&1 | tee "$out/gputests.log" | grep -E "^(FAILED|ERROR)|passed|failed|^E " | head -20
    RPP_GPU_MEMORY=80GiB timeout -s ABRT 150 python3 bench/stale_memory_check.py --workload qwen3-8b --lora 16 --layers 2 --seq 65536 --calls 3 2>&1 | grep -E "^call|^  |kept|Error" | tee "$out/stale.log" ;;
  s27d)  # issue 38 part 2 on one GPU, twenty-seventh session, call 4: s27a's full-depth run again after the planner's flush
    # (the timed call now plans with the first call's capacity: 14 stage inputs on the GPU, as the estimate counts)
    RPP_GPU_MEMORY=80GiB RPP_STAGE_INPUTS=int8 timeout -s ABRT 440 python3 bench/long_context.py --workload qwen3-8b --lora 16 --lengths 262144 --warmup-len 8192 --skip-baseline --memory-detail --out "$out/full262k.json" 2>&1 | quiet | tee "$out/full262k.log" | grep -v "^ *$" | tail -14 ;;
  s27e)  # issues 36/40 (one GPU, carry [".whl", ".old"]), twenty-seventh session, call 5: the bench on the final tree beside
    # the tree before the restructuring (.old = 42ce6e4), qwen3-1.7b 8 x 4096 (the planner's flush changes later calls' room)
    b="bench/train_bench.py --workload qwen3-1.7b --skip-baseline --warmup 3 --iters 6"
    timeout -s ABRT 110 python3 $b 2>&1 | quiet | tee "$out/bench1.log" | grep -E "^\\| roundpipe|Error"
    (cd .old && PYTHONPATH=$PWD:/tmp/site timeout -s ABRT 100 python3 $b 2>&1 | quiet | tee "$out/old.log" | grep -E "^\\| roundpipe|Error") ;;
  s28a)  # issue 36's job-count row on one GPU (twenty-eighth session, call 1): qwen3-1.7b 16 x 4096 at 4, 16 and
    # 8 microbatches, one process each (the same plan search per row), 3 warm-up + 4 timed iterations
    for mb in 4 16 8; do
      timeout -s ABRT 150 python3 bench/train_bench.py --workload qwen3-1.7b --batch 16 --microbatches $mb --skip-baseline \
        --warmup 3 --iters 4 2>&1 | quiet | tee "$out/mb$mb.log" | grep -E "^\\| roundpipe|Error"
    done ;;
  s28b)  # issue 36's job-count row on one GPU, call 2: the same rows with graphed jobs (RPP_DEBUG_GRAPHS=1; auto graphs
    # pools of several GPUs only), then eagerly again, one process each
    for run in "1 16" "1 4" "0 16" "0 4"; do
      set -- $run
      RPP_DEBUG_GRAPHS=$1 timeout -s ABRT 150 python3 bench/train_bench.py --workload qwen3-1.7b --batch 16 --microbatches $2 \
        --skip-baseline --warmup 3 --iters 4 2>&1 | quiet | tee "$out/g$1_mb$2.log" | grep -E "^\\| roundpipe|Error"
    done ;;
  s28c)  # call 3: graphed jobs on one GPU where auto leaves them off: qwen3-1.7b 8 x 4096 at the default 2 microbatches
    # and 16 x 4096 at 8, graphed (RPP_DEBUG_GRAPHS=1) and eager, one process each
    for run in "1 8 2" "0 8 2" "1 16 8" "0 16 8"; do
      set -- $run
      RPP_DEBUG_GRAPHS=$1 timeout -s ABRT 130 python3 bench/train_bench.py --workload qwen3-1.7b --batch $2 --microbatches $3 \
        --skip-baseline --warmup 3 --iters 4 2>&1 | quiet | tee "$out/g$1_b$2_mb$3.log" | grep -E "^\\| roundpipe|Error"
    done ;;
  s28d)  # call 4 (carry [".whl"]: liger-kernel): the job-count row beside the GPU-resident Liger baseline, which runs the
    # same microbatches as gradient accumulation: qwen3-1.7b 16 x 4096 at 16 and 4 microbatches (eager, auto's choice on
    # one GPU), then roundpipe alone at 16 with graphed jobs
    for mb in 16 4; do
      timeout -s ABRT 200 python3 bench/train_bench.py --workload qwen3-1.7b --batch 16 --microbatches $mb \
        --baseline-microbatches $mb --baselines liger --warmup 3 --iters 4 2>&1 | quiet | tee "$out/liger_mb$mb.log" \
        | grep -E "^\\| (roundpipe|gpu-resident)|Error"
    done
    RPP_DEBUG_GRAPHS=1 timeout -s ABRT 120 python3 bench/train_bench.py --workload qwen3-1.7b --batch 16 --microbatches 16 \
      --skip-baseline --warmup 3 --iters 4 2>&1 | quiet | tee "$out/g1_mb16.log" | grep -E "^\\| roundpipe|Error" ;;
  s28e)  # call 5 (carry [".whl"]: liger-kernel), issue 37 part 1 in one call: per workload the bench beside the GPU-resident
    # Liger baseline (one process, 3 warm-up + 6 timed), then the user script (3 warm-up + 6 timed + its final synchronize)
    for w in qwen3-1.7b qwen3-4b; do
      timeout -s ABRT 200 python3 bench/train_bench.py --workload $w --baselines liger --warmup 3 --iters 6 2>&1 | quiet \
        | tee "$out/bench_$w.log" | grep -E "^\\| (roundpipe|gpu-resident)|Error"
      timeout -s ABRT 150 python3 bench/user_script.py --workload $w --batch 8 2>&1 | tee "$out/script_$w.log" \
        | grep -E "user script|step returns|Error"
    done ;;
  s28f)  # call 6: issue 37 part 1, where the user script's last step goes: its optimizer steps timed by phase
    timeout -s ABRT 150 python3 bench/user_script.py --workload qwen3-1.7b --batch 8 --step-phases 2>&1 \
      | tee "$out/phases.log" | grep -v -i warn | tail -14 ;;
  s28x2)  # issue 36's two-GPU rows (a two-GPU kind), for the next session, one call: qwen3-1.7b and qwen3-4b 16 x 4096 on
    # 1 GPU then 2 (one process per pool, target >= 1.9x), then the job count on 2 GPUs (16 microbatches against 4)
    export PYTHONFAULTHANDLER=1
    b="python3 bench/train_bench.py --batch 16 --skip-baseline --warmup 3 --iters 4"
    for v in "qwen3-1.7b 0 0 110" "qwen3-1.7b 0,1 0 110" "qwen3-4b 0 0 150" "qwen3-4b 0,1 0 150" \
      "qwen3-1.7b 0,1 16 110" "qwen3-1.7b 0,1 4 110"; do
      set -- $v
      CUDA_VISIBLE_DEVICES=$2 timeout -s ABRT $4 $b --workload $1 --microbatches $3 2>&1 | quiet \
        | tee "$out/$1_g${2/,/}_mb$3.log" | grep -E "^\\| roundpipe|Error" | sed "s/^/$1 gpus=$2 mb=$3 /"
    done ;;
  s28h)  # for the next session (one GPU): RPP_FUSED_STAGING off and on side by side, the user script's step phases and
    # the bench (qwen3-1.7b 8 x 4096), then the GPU tests on this tree
    for f in 0 1; do
      RPP_FUSED_STAGING=$f timeout -s ABRT 130 python3 bench/user_script.py --workload qwen3-1.7b --batch 8 --step-phases \
        2>&1 | tee "$out/phases$f.log" | grep -v -i warn | tail -12 | sed "s/^/fused=$f /"
      RPP_FUSED_STAGING=$f timeout -s ABRT 110 python3 bench/train_bench.py --workload qwen3-1.7b --skip-baseline --warmup 3 \
        --iters 6 2>&1 | quiet | tee "$out/bench$f.log" | grep -E "^\\| roundpipe|optimizer step sec|Error" | sed "s/^/fused=$f /"
    done
    timeout -s ABRT 150 python3 -m pytest -m gpu tests -q -p no:cacheprovider 2>&1 | tail -3 ;;
  s29a)  # twenty-ninth session, call 1 (nvidia-h200-x2): issue 36's two-GPU rows, one process per pool (qwen3-1.7b and
    # qwen3-4b 16 x 4096 on 1 GPU then 2), then every GPU test on two GPUs in the time left
    export PYTHONFAULTHANDLER=1
    nvidia-smi -L; nvidia-smi topo -m 2>&1 | head -6 | tee "$out/topo.log"
    b="python3 bench/train_bench.py --batch 16 --skip-baseline --warmup 3 --iters 4"
    for v in "qwen3-1.7b 0 110" "qwen3-1.7b 0,1 110" "qwen3-4b 0 150" "qwen3-4b 0,1 150"; do
      set -- $v; t=$(( $3 < 450 - SECONDS ? $3 : 450 - SECONDS )); [ $t -gt 20 ] || break
      CUDA_VISIBLE_DEVICES=$2 timeout -s ABRT $t $b --workload $1 2>&1 | quiet | tee "$out/$1_g${2/,/}.log" \
        | grep -E "^\\| roundpipe|Error" | sed "s/^/$1 gpus=$2 t=${SECONDS}s /"
    done
    timeout -s ABRT $(( 590 - SECONDS )) python3 -m pytest -m gpu tests -q -rA -p no:cacheprovider 2>&1 \
      | tee "$out/gputests.log" | grep -E "^(FAILED|ERROR)|passed|failed|^E " | head -30 ;;
  s29b)  # call 2 (nvidia-h200-x2): the expandable segments' handle-type race without and with roundpipe's settle, and its
    # GPU test; qwen3-1.7b 16 x 4096 on 1 GPU then 2 on defaults; issue 37 part 2 on two GPUs (qwen3-8b LoRA 131,072
    # under a 24 GiB cap, no allocator variable, the plan beside it); 8 tiles of 32,768 tokens on 2 GPUs with expandable
    # segments on; RPP_FUSED_STAGING off and on (the user script, one GPU) in the time left
    export PYTHONFAULTHANDLER=1
    timeout 120 python3 bench/handle_type_race.py --trials 24 --parallel 8 2>&1 | tail -3
    timeout -s ABRT 90 python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider -k first_segments 2>&1 | tail -2
    for g in 0 0,1; do
      CUDA_VISIBLE_DEVICES=$g timeout -s ABRT 110 python3 bench/train_bench.py --batch 16 --skip-baseline --warmup 3 \
        --iters 4 --workload qwen3-1.7b 2>&1 | quiet | tee "$out/17b_g${g/,/}.log" | grep -E "^\\| roundpipe|Error" | sed "s/^/gpus=$g t=${SECONDS}s /"
    done
    python3 -m roundpipe plan --model qwen3-8b --seq-len 131072 --lora-r 16 --gpu-memory 24GiB --gpus 2 2>&1 | grep -i peak
    RPP_GPU_MEMORY=24GiB timeout -s ABRT $(( 400 - SECONDS < 250 ? 400 - SECONDS : 250 )) python3 bench/long_context.py \
      --workload qwen3-8b --lora 16 --lengths 131072 --skip-baseline --memory-detail --out "$out/capped8b2.json" 2>&1 \
      | quiet | tee "$out/capped8b2.log" | grep -v "^ *$" | tail -10
    t=$(( 450 - SECONDS )); [ $t -gt 40 ] && timeout -s ABRT $(( t < 100 ? t : 100 )) python3 bench/pool_bench.py \
      --workload qwen3-8b --lora 16 --batch 1 --seq 32768 --devices 2 --graphs 0 --sequence-tiles 8 --warmup 1 --iters 1 \
      2>&1 | quiet | tee "$out/tiles32k.log" | grep -E "tokens/s|Error|error"
    for f in 0 1; do
      t=$(( 500 - SECONDS )); [ $t -gt 50 ] || break
      CUDA_VISIBLE_DEVICES=0 RPP_FUSED_STAGING=$f timeout -s ABRT $t python3 bench/user_script.py --workload qwen3-1.7b \
        --batch 8 --step-phases 2>&1 | tee "$out/phases$f.log" | grep -v -i warn | tail -12 | sed "s/^/fused=$f /"
    done ;;
  s30x2a)  # for the next session (a two-GPU kind), call 1: issue 37 part 2 on 2 GPUs after the fix for the graphs'
    # leftovers (qwen3-8b LoRA 131,072 under a 24 GiB cap, no allocator variable; the twenty-ninth session's run was
    # refused), the plan beside it; the job count on 2 GPUs (qwen3-1.7b 16 x 4096, 16 microbatches against 4); the
    # GPU tests of the devices and graphs in the time left
    export PYTHONFAULTHANDLER=1
    python3 -m roundpipe plan --model qwen3-8b --seq-len 131072 --lora-r 16 --gpu-memory 24GiB --gpus 2 2>&1 | grep -i peak
    RPP_GPU_MEMORY=24GiB timeout -s ABRT 260 python3 bench/long_context.py --workload qwen3-8b --lora 16 --lengths 131072 \
      --skip-baseline --memory-detail --out "$out/capped8b2.json" 2>&1 | quiet | tee "$out/capped8b2.log" | grep -v "^ *$" | tail -10
    for m in 16 4; do
      t=$(( 480 - SECONDS )); [ $t -gt 30 ] || break
      timeout -s ABRT $(( t < 110 ? t : 110 )) python3 bench/train_bench.py --batch 16 --skip-baseline --warmup 3 --iters 4 \
        --workload qwen3-1.7b --microbatches $m --host-allocs 2>&1 | quiet | tee "$out/mb$m.log" \
        | grep -E "^\\| roundpipe|Error|pinned blocks|host allocs|MiB at" | sed "s/^/gpus=2 mb=$m /"
    done
    timeout -s ABRT $(( 590 - SECONDS )) python3 -m pytest -m gpu tests/test_gpu.py tests/test_graphs.py -q -p no:cacheprovider \
      2>&1 | tail -3 ;;
  s30x2b)  # call 2 (a two-GPU kind): issue 38's 262,144-token row with two timed steps on 2 GPUs (the first full-length
    # step pins 38.6 GB of host blocks), then the 2-GPU row alone; the 1-GPU row is the twenty-ninth session's 215.0 s
    # unless time is left (then: s27x2b)
    export PYTHONFAULTHANDLER=1
    timeout -s ABRT 560 python3 bench/pool_bench.py --workload qwen3-8b --lora 16 --batch 1 --seq 262144 --devices 2 \
      --graphs 0 --sequence-tiles 8 --warmup 1 --warmup-seq 8192 --iters 2 --json "$out/tiles262k2.json" 2>&1 | quiet \
      | tee "$out/tiles262k2.log" | grep -E "tokens/s|iterations|Error|error" ;;
  s30a)  # thirtieth session, call 1 (one GPU; the several-GPU kinds are withheld): every GPU test on the final tree;
    # then the graph-slot fix (7f38b74) on one GPU: qwen3-8b LoRA 131,072 under a 24 GiB cap, no allocator variable,
    # with graphs forced on (RPP_DEBUG_GRAPHS=1), so the 4,096-token warm-up leaves graphs and slots as 2 GPUs' default does
    export PYTHONFAULTHANDLER=1
    nvidia-smi -L
    timeout -s ABRT 300 python3 -m pytest -m gpu tests -q -rA -p no:cacheprovider 2>&1 | tee "$out/gputests.log" \
      | grep -E "^(FAILED|ERROR)|passed|failed|^E " | head -30
    RPP_DEBUG_GRAPHS=1 RPP_GPU_MEMORY=24GiB timeout -s ABRT $(( 590 - SECONDS )) python3 bench/long_context.py --workload qwen3-8b \
      --lora 16 --lengths 131072 --skip-baseline --memory-detail --out "$out/capped8b_graphs.json" 2>&1 | quiet \
      | tee "$out/capped8b_graphs.log" | grep -v "^ *$" | tail -12 ;;
  s30b)  # call 2 (one GPU, carry [".whl"]: liger-kernel): the final tree's bench beside Liger and the user script (plain,
    # then with its step function declared for fused staging), per workload in one call
    for w in qwen3-1.7b qwen3-4b; do
      t=$(( 580 - SECONDS )); [ $t -gt 60 ] || break
      timeout -s ABRT $(( t < 200 ? t : 200 )) python3 bench/train_bench.py --workload $w --baselines liger --warmup 3 \
        --iters 6 2>&1 | quiet | tee "$out/bench_$w.log" | grep -E "^\\| (roundpipe|gpu-resident)|Error"
      for d in "" --declared; do
        t=$(( 580 - SECONDS )); [ $t -gt 40 ] || break
        timeout -s ABRT $(( t < 130 ? t : 130 )) python3 bench/user_script.py --workload $w --batch 8 $d 2>&1 \
          | tee "$out/script_$w$d.log" | grep -E "user script|step returns|Error" | sed "s/^/$d /"
      done
    done ;;
  next4c)  # issue 39 (a 4-GPU kind): with the handle-type race fixed, do graphed jobs on 4 GPUs run with expandable
    # segments (the reason import roundpipe leaves them off above 2 GPUs)? The race check on 4 GPUs, then qwen3-1.7b
    # 16 x 4096 graphed with and without them, one process each
    export PYTHONFAULTHANDLER=1
    timeout 120 python3 bench/handle_type_race.py --trials 16 --parallel 4 2>&1 | tail -2
    for a in "expandable_segments:True" "expandable_segments:False"; do
      PYTORCH_ALLOC_CONF=$a RPP_DEBUG_GRAPHS=1 timeout -s ABRT 200 python3 bench/train_bench.py --workload qwen3-1.7b --batch 16 \
        --skip-baseline --warmup 3 --iters 4 2>&1 | quiet | grep -E "^\\| roundpipe|Error" | sed "s/^/$a /"
    done ;;
  next4d)  # issues 38/39 run 7 (a 4-GPU kind): qwen3-8b LoRA, one 262,144-token sequence: 8 tiles on 4 GPUs, then the whole
    # sequence on 1 (target >= 3.3x); then 8 tiles on 4 GPUs under a 24 GiB cap with no allocator variable (must complete;
    # roundpipe plan predicts 20.2 GiB), the plan beside it
    export PYTHONFAULTHANDLER=1
    python3 -m roundpipe plan --model qwen3-8b --seq-len 262144 --lora-r 16 --gpus 4 --sequence-tiles 8 --gpu-memory 24GiB \
      --host-memory 480GiB 2>&1 | grep -E "peak|fit"
    p="python3 bench/pool_bench.py --workload qwen3-8b --lora 16 --batch 1 --seq 262144 --graphs 0 --sequence-tiles 8 --warmup 1 --warmup-seq 8192 --iters 1"
    timeout -s ABRT 420 $p --devices 4,1 --json "$out/tiles4.json" 2>&1 | quiet | tee "$out/tiles4.log" | grep -E "tokens/s|iterations|Error|error"
    RPP_GPU_MEMORY=24GiB timeout -s ABRT $(( 585 - SECONDS )) $p --devices 4 --json "$out/tiles4cap.json" 2>&1 | quiet \
      | tee "$out/tiles4cap.log" | grep -E "tokens/s|iterations|Error|error" | sed "s/^/24GiB /" ;;
  *) echo "usage: bash bench/gpu_session.sh refactor|context8b|context17b|capped|host|streamed|lora32|issue22|first|first2|first3|floor|saved|gaps|gaps2|auto|auto2|first4|tied|liger4b|user|seqtiles|gcfreeze|x4a|x4b|x4c|x4d|next1|next4|next4b|s24a|s25a|s25b|s25c|s25d|s25e|s25f|s26a|s26b|s26c|s27x2a|s27x2b|s27a|s27b|s27c|s27d|s27e|s28a|s28b|s28c|s28d|s28e|s28f|s28x2|s28h|s29a|s29b|s27x2b|s30x2a|s30x2b|s30a|s30b|next4c|next4d" >&2; exit 2 ;;
esac
