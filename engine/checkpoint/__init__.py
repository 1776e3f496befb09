"""Checkpoints in the Hugging Face layout: generate, validate, load, quantize."""
