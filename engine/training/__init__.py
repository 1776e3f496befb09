"""Training the `tiny-chat` preset: synthetic K3 chat corpus, batched trainer, per-family evaluation."""
