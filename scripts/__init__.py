"""A regular package, so that `python -m scripts.bench.lab.probe` from the checkout finds this folder before any
installed distribution's `scripts`."""
