"""The lab that benchmarks and tests share, apart from the daemon's packages: a gossip-only probe peer
(`probe`), what a hostile one does below gossip (`attacks`), and a network of Linux namespaces (`netlab`) whose
middle can be slow and lossy (`lossy_link`).

Benchmark scripts import it as `lab` (their own folder is on their path), as do the tests (pytest's
`pythonpath`); a child process runs it as `python -m scripts.bench.lab.probe` from the checkout's root."""
