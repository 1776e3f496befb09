#!/usr/bin/env bash
# One DECODE data-parallel rank of Kimi-K3 W4A8 on Atlas A3 with vLLM-Ascend (MooncakeConnectorV1,
# kv_consumer: it pulls the prompt's KV cache and KDA state from the prefill rank named in the
# request's kv_transfer_params). Run once per decode rank, inside a vLLM-Ascend Kimi-K3 image.
# UNVERIFIED: no A3 was available when this was written. See deploy/ascend/README.md.
#
#   MODEL_PATH=/models/Kimi-K3-w4a8 LOCAL_IP=10.0.1.11 NIC_NAME=eth0 DP_MASTER_IP=10.0.1.11 \
#   DP_RANK=0 bash deploy/ascend/decode.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

PORT=${PORT:-8200}           # this rank's OpenAI API port: one `--decode http://LOCAL_IP:PORT` on the router
KV_PORT=${KV_PORT:-36200}    # tutorial (decode side)

export HCCL_OP_EXPANSION_MODE=AIV   # tutorial: decode side only

args=(
    vllm serve "$MODEL_PATH"
    --host 0.0.0.0
    --port "$PORT"
    --served-model-name "$SERVED_MODEL_NAME"
    --trust-remote-code
    --quantization ascend                      # ModelSlim W4A8 (omit for a compressed-tensors checkpoint)
    --data-parallel-size "$DECODE_DP"
    --data-parallel-rank "$DP_RANK"            # external DP: every rank is its own API server
    --data-parallel-address "$DP_MASTER_IP"
    --data-parallel-rpc-port "$DP_RPC_PORT"
    --tensor-parallel-size "$DECODE_TP"
    --enable-expert-parallel                   # EP = DP x TP over the routed experts
    --seed 1024
    --max-model-len "$MAX_MODEL_LEN"
    --max-num-batched-tokens "${MAX_NUM_BATCHED_TOKENS:-8192}"   # tutorial
    --max-num-seqs "${MAX_NUM_SEQS:-16}"                         # tutorial
    --gpu-memory-utilization 0.9
    --compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}'   # graph replay for decode steps
    --enable-prefix-caching
    --mamba-cache-mode align                   # KDA state cached/transferred at block boundaries
    --mm-encoder-tp-mode data
    --skip-mm-profiling
    --limit-mm-per-prompt '{"vision_chunk": 2}'
    --safetensors-load-strategy prefetch
    --tokenizer-mode kimi_k3
    # The decode rank writes what the client sees: reasoning and tool calls are parsed here.
    --reasoning-parser kimi_k3
    --tool-call-parser kimi_k3
    --enable-auto-tool-choice
    # Off as in the tutorial. RECOMPUTE_SCHEDULER=true lets a rank short of KV memory give a request
    # back (`stop_reason: "recomputed"`); the kimi-pd router then runs the rest of it from a prefill.
    --additional-config "{\"recompute_scheduler_enable\": ${RECOMPUTE_SCHEDULER:-false}}"
    --kv-transfer-config "$(kv_transfer_config kv_consumer "$KV_PORT")"
)
run "${args[@]}"
