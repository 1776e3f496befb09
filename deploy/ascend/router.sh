#!/usr/bin/env bash
# kimi-pd router in front of the vLLM-Ascend prefill and decode ranks started by prefill.sh and
# decode.sh, as static workers: no kimi-pd workers involved. `--kv-connector mooncake-ascend` makes
# the router speak vLLM-Ascend's MooncakeConnectorV1 protocol: the prefill leg carries
# kv_transfer_params {do_remote_decode: true} and min_tokens 1 (so the one prefill token is never an
# end token and the rank always answers the parameters), and the decode leg carries the
# kv_transfer_params the prefill rank answered with, verbatim (remote_host, remote_port,
# remote_engine_id, remote_block_ids, ...). The ranks get no kimi-pd internal call and never the
# router's admin token. Needs no NPU: runs from deploy/docker/Dockerfile (CPU) or Dockerfile.ascend.
# Checked against protocol stubs of the ranks (tests/deploy/test_ascend_router.py); not against real
# vLLM-Ascend ranks. See deploy/ascend/README.md.
#
#   PREFILL_URLS="http://10.0.0.11:8100 http://10.0.0.12:8100" \
#   DECODE_URLS="http://10.0.1.11:8200 http://10.0.1.12:8200" \
#   ROUTER_MODEL_DIR=/models/Kimi-K3-w4a8 bash deploy/ascend/router.sh
set -euo pipefail

: "${PREFILL_URLS:?set PREFILL_URLS to the prefill ranks API URLs, space-separated (one per prefill.sh run)}"
: "${DECODE_URLS:?set DECODE_URLS to the decode ranks API URLs, space-separated (one per decode.sh run)}"
# The router reads config.json and the tokenizer from here (not the weights), to hash prompt prefixes
# the way the engines do. The Kimi-K3 checkpoint directory itself is the simplest choice.
: "${ROUTER_MODEL_DIR:?set ROUTER_MODEL_DIR to a directory with the Kimi-K3 config.json and tokenizer files}"
# The admin token guards the router's /admin endpoints (export it; never put it on the command line).
: "${KIMI_PD_ADMIN_TOKEN:?export KIMI_PD_ADMIN_TOKEN (guards the /admin endpoints of the router)}"

args=(
    router
    --model "$ROUTER_MODEL_DIR"
    --host "${ROUTER_HOST:-0.0.0.0}"
    --port "${ROUTER_PORT:-8000}"
    --served-model-name "${SERVED_MODEL_NAME:-kimi-k3}"   # the ranks' --served-model-name
    # The ranks' P/D protocol. Without it the router would take them for kimi-pd workers: it refuses
    # to start when a rank answers as stock vLLM.
    --kv-connector mooncake-ascend
    # The engines' KV block size, for the router's prefix index of static workers. vLLM logs the block
    # size it chose at start-up (hybrid KDA models may align it to the state size): copy it here. A
    # mismatch only makes prefix-aware placement less accurate.
    --block-size "${ROUTER_BLOCK_SIZE:-128}"
    # Prompts of up to ~128k tokens: the prefill leg of a long prompt can take minutes on the
    # eager-mode prefill ranks (placeholder; measure).
    --prefill-timeout "${ROUTER_PREFILL_TIMEOUT:-600}"
    --idle-timeout "${ROUTER_IDLE_TIMEOUT:-300}"
    # Decode-only (no prefill leg) when fewer prompt tokens than this are uncached on the chosen
    # decode rank; 0 sends every request through a prefill rank.
    --disagg-threshold "${ROUTER_DISAGG_THRESHOLD:-32}"
)
# A KV pool behind the prefill ranks (the tutorial's MultiConnector with AscendStoreConnector, added to
# prefill.sh's --kv-transfer-config): its capacity in the engines' KV blocks, so placement counts a prefix
# that any rank computed as a cheap hit on every rank, and what loading a token from it costs as a share of
# computing it (measure the pool's read rate against a rank's prefill rate). Unset or 0: no pool.
if [[ "${ROUTER_KV_POOL_BLOCKS:-0}" != 0 ]]; then
    args+=(--kv-pool-blocks "$ROUTER_KV_POOL_BLOCKS" --kv-pool-load-cost "${ROUTER_KV_POOL_LOAD_COST:-0.1}")
fi
for url in $PREFILL_URLS; do args+=(--prefill "$url"); done
for url in $DECODE_URLS; do args+=(--decode "$url"); done

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%s\0' kimi-pd "${args[@]}"
    exit 0
fi
exec kimi-pd "${args[@]}"
