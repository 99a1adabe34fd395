"""The policy: model loading, generation backends, batch building, the GRPO update, checkpoints."""
