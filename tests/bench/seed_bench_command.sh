# The seed's benchmark command (vLLM-Ascend's Kimi-K3 tutorial, "Using vLLM Benchmark"), as written.
# tests/bench/test_seed_command.py runs it with `vllm` replaced by `kimi-pd`, NODE0_IP pointing at a
# local server and TOKENIZER_PATH at a checkpoint: the argument list itself is not edited.
vllm bench serve \
  --backend openai-chat \
  --base-url "http://$NODE0_IP:8000" \
  --endpoint /v1/chat/completions \
  --model kimi-k3 \
  --tokenizer "$TOKENIZER_PATH" \
  --tokenizer-mode kimi_k3 \
  --dataset-name random \
  --random-input-len 1024 \
  --random-output-len 128 \
  --random-range-ratio 0.0 \
  --num-prompts 100 \
  --max-concurrency 4 \
  --request-rate inf \
  --ignore-eos \
  --save-result \
  --result-dir ./benchmark-results
