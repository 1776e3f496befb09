"""Decode graph capture (vLLM's `cudagraph_mode: FULL_DECODE_ONLY`): fixed batch-size buckets, padded
replay, CUDA graphs or NPU graphs (torch-npu) where the device has them, eager everywhere else."""
