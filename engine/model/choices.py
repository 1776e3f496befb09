"""Every place where public Kimi-K3 sources disagree, and the reading this project implements.

docs/model.md section 14 lists the conflicts. The constants are switches: the model code imports
them instead of re-deciding, so changing one changes the reading (and the parity tests say what broke).
The notes at the end are readings fixed by the shape of the code itself: they are documented here, and
changing one means changing that code, not a constant.
"""
from __future__ import annotations

# KDA `A_log` is stored as a flat [head_dim] tensor: num_heads per-head values, then zeros.
# Reading: per head (`A_log[:num_heads]`), as vLLM-Ascend's loader and the llama.cpp parity claim do.
A_LOG_PER_HEAD: bool = True

# eps of MLA `q_a_layernorm` / `kv_a_layernorm`: the serving engines use `rms_norm_eps` (1e-5),
# the HF-derived reference uses 1e-6. We follow the serving engines.
MLA_LATENT_NORM_USES_RMS_NORM_EPS: bool = True

# W4A8 routed experts are per-channel (group_size 0); int4 pairs are packed along the output
# dimension, low nibble = even row, high nibble = odd row (vLLM-Ascend `_pack_int4_to_int8` order).
W4A8_GROUP_SIZE: int = 0
W4A8_LOW_NIBBLE_IS_EVEN_ROW: bool = True

# ---- notes: readings fixed by the code's shape (no switch) -------------------------------------
# `vt_hidden_size` (1024 vs 1152): always read from the checkpoint's vision_config.
# KDA recurrent state layout: key-major [H, K, V] (fla convention). V-first kernels transpose
# at their boundary.
# KDA short-conv state keeps the last W-1 pre-conv inputs of q, k, v, concatenated along channels
# in that order: shape [W-1, 3*H*K] (vLLM's "SD" orientation).
# The `<|media_pad|>` placeholder is expanded by the prompt builder to one token per merged image
# patch, so token positions, prefix hashes and cache lengths all count image tokens.
