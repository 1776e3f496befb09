#!/usr/bin/env bash
# One PREFILL data-parallel rank of Kimi-K3 W4A8 on Atlas A3 with vLLM-Ascend (MooncakeConnectorV1,
# kv_producer). Run once per prefill rank (one per node with TP16), inside a vLLM-Ascend Kimi-K3
# image (deploy/docker/Dockerfile.ascend or quay.io/ascend/vllm-ascend:kimi-k3-a3).
# UNVERIFIED: no A3 was available when this was written. See deploy/ascend/README.md.
#
#   MODEL_PATH=/models/Kimi-K3-w4a8 LOCAL_IP=10.0.0.11 NIC_NAME=eth0 DP_MASTER_IP=10.0.0.11 \
#   DP_RANK=0 bash deploy/ascend/prefill.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

PORT=${PORT:-8100}           # this rank's OpenAI API port: one `--prefill http://LOCAL_IP:PORT` on the router
KV_PORT=${KV_PORT:-36000}    # tutorial (prefill side)

# The router does not release a prefill's blocks on vLLM (kimi-pd's /internal/kv/release is its own
# workers' API). A request whose decode leg never arrives keeps its blocks until this timeout (seconds).
export VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT=${VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT:-480}

args=(
    vllm serve "$MODEL_PATH"
    --host 0.0.0.0
    --port "$PORT"
    --served-model-name "$SERVED_MODEL_NAME"
    --trust-remote-code
    --quantization ascend                      # ModelSlim W4A8 (omit for a compressed-tensors checkpoint)
    --data-parallel-size "$PREFILL_DP"
    --data-parallel-rank "$DP_RANK"            # external DP: every rank is its own API server
    --data-parallel-address "$DP_MASTER_IP"
    --data-parallel-rpc-port "$DP_RPC_PORT"
    --tensor-parallel-size "$PREFILL_TP"
    --enable-expert-parallel                   # EP = DP x TP over the routed experts
    --seed 1024
    --max-model-len "$MAX_MODEL_LEN"
    --max-num-batched-tokens "${MAX_NUM_BATCHED_TOKENS:-8192}"   # tutorial
    --max-num-seqs "${MAX_NUM_SEQS:-16}"                         # tutorial
    --gpu-memory-utilization 0.9
    --enforce-eager                            # tutorial: prefill runs eagerly, decode uses graphs
    --enable-prefix-caching
    --mamba-cache-mode align                   # KDA state cached/transferred at block boundaries
    --mm-encoder-tp-mode data
    --skip-mm-profiling
    --limit-mm-per-prompt '{"vision_chunk": 2}'
    --safetensors-load-strategy prefetch
    --tokenizer-mode kimi_k3
    --reasoning-parser kimi_k3
    --tool-call-parser kimi_k3
    --enable-auto-tool-choice
    # Off as in the tutorial; the recompute scheduler acts on the decode side (decode.sh RECOMPUTE_SCHEDULER).
    --additional-config "{\"recompute_scheduler_enable\": ${RECOMPUTE_SCHEDULER:-false}}"
    --kv-transfer-config "$(kv_transfer_config kv_producer "$KV_PORT")"
)
run "${args[@]}"
