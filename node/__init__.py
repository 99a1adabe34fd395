"""The node daemon: config, CLI, the round loop, metrics, checkpoints and graceful stop."""
