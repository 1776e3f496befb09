"""The OpenAI-compatible protocol layer shared by the router and the workers.

`models` (request/response schemas), `convert` (requests -> engine inputs, engine text -> OpenAI
messages), `errors` (one mapping of exceptions to OpenAI error bodies), `sse` (event framing and an
incremental parser), `legs` (the prefill/decode requests of vLLM's P/D protocol).
"""
