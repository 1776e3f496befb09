#!/usr/bin/env bash
# The seed's colocated topology: Kimi-K3 W4A8 served as DP4/TP16/EP64 over four A3 nodes, node 0 with
# the HTTP server, nodes 1-3 headless (their DP rank only). These two argument lists are THE reference
# lines: tests/worker/test_seed_flags.py runs them, as written, through `kimi-pd serve`'s parser.
# UNVERIFIED on A3, like the rest of deploy/ascend. Which flag does what under kimi-pd: docs/deployment.md.
#
#   node 0:    MODEL_PATH=/models/Kimi-K3-w4a8 DSPARK_DRAFT_PATH=/models/Kimi-K3-DSpark LOCAL_IP=10.0.0.11 \
#              NIC_NAME=eth0 DP_MASTER_IP=10.0.0.11 NODE_RANK=0 bash deploy/ascend/seed.sh
#   node 1..3: the same with NODE_RANK=1..3 (and that node's LOCAL_IP / NIC_NAME)
#   SERVER="kimi-pd serve" runs the same lines on kimi-pd's engine instead of `vllm serve`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

: "${DSPARK_DRAFT_PATH:?set DSPARK_DRAFT_PATH to the DSpark draft checkpoint directory}"
NODE_RANK=${NODE_RANK:-0}                 # 0 serves HTTP; 1..3 are headless
SEED_PORT=${SEED_PORT:-8000}
SEED_RPC_PORT=${SEED_RPC_PORT:-13389}
read -r -a server <<< "${SERVER:-vllm serve}"

speculative_config='{"method": "dspark", "model": "'"$DSPARK_DRAFT_PATH"'", "num_speculative_tokens": 7, "draft_tensor_parallel_size": 16, "max_model_len": 4096, "draft_sample_method": "greedy", "enforce_eager": true}'

args=(
    "${server[@]}" "$MODEL_PATH"
    --host 0.0.0.0
    --port "$SEED_PORT"
    --served-model-name kimi-k3
    --tokenizer "$MODEL_PATH"
    --quantization ascend
    --safetensors-load-strategy prefetch
    --data-parallel-size 4
    --data-parallel-size-local 1
    --data-parallel-address "$DP_MASTER_IP"
    --data-parallel-rpc-port "$SEED_RPC_PORT"
    --tensor-parallel-size 16
    --enable-expert-parallel
    --max-model-len 133120
    --max-num-batched-tokens 8192
    --max-num-seqs 16
    --gpu-memory-utilization 0.9
    --enable-prefix-caching
    --tokenizer-mode kimi_k3
    --reasoning-parser kimi_k3
    --tool-call-parser kimi_k3
    --enable-auto-tool-choice
    --speculative-config "$speculative_config"
)
if [[ "$NODE_RANK" != 0 ]]; then
    args+=(--headless --data-parallel-start-rank "$NODE_RANK")
fi
run "${args[@]}"
