"""Benchmarks and experiments, each a script that writes its JSON to docs/bench/ (docs/bench/README.md)."""
