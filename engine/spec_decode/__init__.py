"""DSpark speculative decoding (docs/dspark.md): draft config + checkpoint, draft model, proposer, verification."""
