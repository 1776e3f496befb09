#!/usr/bin/env bash
# Sourced by prefill.sh and decode.sh: placeholders every node must set, the NPU / HCCL environment,
# and the --kv-transfer-config both roles share. UNVERIFIED: written without an Atlas A3 at hand,
# from vLLM-Ascend's Kimi-K3 tutorial (validated there on vLLM-Ascend 0.23.0) and its Mooncake P/D
# guides. Values marked "tutorial" are the ones that tutorial used for its 8 P + 8 D node layout.

# ---- placeholders: set these in the environment of each node (the scripts refuse to start without) --
: "${MODEL_PATH:?set MODEL_PATH to the Kimi-K3 W4A8 checkpoint directory (e.g. Eco-Tech/Kimi-K3-w4a8, on shared storage)}"
: "${LOCAL_IP:?set LOCAL_IP to the address of this node on the HCCL / KV network}"
: "${NIC_NAME:?set NIC_NAME to the interface that owns LOCAL_IP}"
: "${DP_MASTER_IP:?set DP_MASTER_IP to the LOCAL_IP of DP rank 0 of this role (prefill and decode are separate DP groups)}"

# ---- topology: placeholders with the tutorial's values ---------------------------------------------
# Kimi-K3 W4A8 is about 1.5 TB of weights: it does not fit one A3 node (16 x 64 GB), so each role is a
# data-parallel group spanning several nodes with experts spread by expert parallelism (EP = DP x TP).
# The tutorial's P/D layout: 8 prefill nodes and 8 decode nodes, DP8/TP16 on each side.
# Each run of prefill.sh / decode.sh starts ONE DP rank with its own API server ("external" DP:
# --data-parallel-rank), so the kimi-pd router sees every rank as a worker and balances across them.
# Both sides must agree on both shapes (the connector maps prefill ranks to decode ranks); with Kimi-K3's
# KDA (Mamba-type) state the connector requires PREFILL_TP >= DECODE_TP and PREFILL_TP % DECODE_TP == 0.
PREFILL_DP=${PREFILL_DP:-8}        # tutorial: 8 (one rank per prefill node)
PREFILL_TP=${PREFILL_TP:-16}       # tutorial: 16 (all NPUs of an A3 node)
DECODE_DP=${DECODE_DP:-8}          # tutorial: 8
DECODE_TP=${DECODE_TP:-16}         # tutorial: 16
DP_RANK=${DP_RANK:-0}              # this process's rank inside its role's DP group: 0 .. DP-1
DP_RPC_PORT=${DP_RPC_PORT:-12321}  # same value on every node of one DP group; free and reachable
ASCEND_RT_VISIBLE_DEVICES=${ASCEND_RT_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}
export ASCEND_RT_VISIBLE_DEVICES  # TP NPUs per rank; two ranks on one node need disjoint lists

SERVED_MODEL_NAME=${SERVED_MODEL_NAME:-kimi-k3}  # must equal the router's --served-model-name
MAX_MODEL_LEN=${MAX_MODEL_LEN:-133120}           # tutorial

# ---- NPU / HCCL environment (tutorial) -------------------------------------------------------------
export HCCL_IF_IP=$LOCAL_IP
export GLOO_SOCKET_IFNAME=$NIC_NAME
export TP_SOCKET_IFNAME=$NIC_NAME
export HCCL_SOCKET_IFNAME=$NIC_NAME
export HCCL_EXEC_TIMEOUT=204
export HCCL_CONNECT_TIMEOUT=120
export HCCL_BUFFSIZE=1024
export VLLM_RPC_TIMEOUT=3600000
export VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=30000
export OMP_PROC_BIND=false
export OMP_NUM_THREADS=10
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export VLLM_ASCEND_ENABLE_MLAPO=1
export TASK_QUEUE_ENABLE=1
export ASCEND_BUFFER_POOL=4:8
# Mooncake's Ascend build ships its shared libraries next to the Python package.
export LD_LIBRARY_PATH=/usr/local/Ascend/ascend-toolkit/latest/python/site-packages/mooncake${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# Proxies must not intercept node-to-node traffic.
unset http_proxy https_proxy ftp_proxy HTTP_PROXY HTTPS_PROXY FTP_PROXY

# kv_transfer_config ROLE KV_PORT -> the JSON for --kv-transfer-config.
#   ROLE: kv_producer (prefill) or kv_consumer (decode).
#   KV_PORT: the connector's side-channel base port. Mooncake's Ascend Direct Transport takes random
#   ports in [20000, 20000 + 1000 x NPUs per node), so on 16-NPU A3 nodes use >= 36000 (tutorial:
#   36000 for prefill, 36200 for decode).
#   use_ascend_direct: Mooncake over CANN ADXL (Ascend Direct Transport; needs CANN >= 8.3.RC1 and a
#   Mooncake built with USE_ASCEND_DIRECT, as the vLLM-Ascend images ship it). Older vLLM-Ascend
#   releases read this key; the current connector always starts Mooncake with its "ascend" protocol
#   and ignores it, so it is kept for the older ones and is harmless otherwise.
#   engine_id is left out: vLLM then gives every instance a unique one.
kv_transfer_config() {
    local role=$1 kv_port=$2
    printf '{"kv_connector": "MooncakeConnectorV1", "kv_role": "%s", "kv_port": "%s", "kv_connector_extra_config": {"use_ascend_direct": true, "prefill": {"dp_size": %d, "tp_size": %d}, "decode": {"dp_size": %d, "tp_size": %d}}}' \
        "$role" "$kv_port" "$PREFILL_DP" "$PREFILL_TP" "$DECODE_DP" "$DECODE_TP"
}

# run CMD...: exec it, or with DRY_RUN=1 print it, one NUL-terminated argument at a time (what
# tests/deploy checks: the JSON parses, the flags are the intended ones).
run() {
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%s\0' "$@"
        return 0
    fi
    exec "$@"
}
