"""DSpark speculative decoding (DSPARK.md): draft config + checkpoint, draft model, proposer, verification."""
