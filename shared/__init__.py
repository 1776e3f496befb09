"""The ground floor every process imports: protocol types (OpenAI models, kv_transfer params, worker
records, errors, sampling params, the config.json schema), block hashing, KV events, the state store,
HTTP/SSE helpers and the prompt path (tokenizer, chat renderer, parsers). Torch-free and importing nothing
else of the project, so the router computes exactly what the workers do without loading the engine."""
