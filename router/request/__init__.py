"""One client request's journey through the fleet, a module per stage: the outline (`router.orchestrator`),
the prefill leg (`prefill`), the decode leg (`decode`), the streamed relay with mid-stream migration
(`relay`, over `migration`), and what they share (`fleet`, `trace`)."""
