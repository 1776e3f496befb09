"""The worker service: the OpenAI server over the engine (app, runtime, presence, metrics). It knows no
role; a role (`worker.role.Role`) brings the legs it serves (`prefill_worker`, `decode_worker`)."""
