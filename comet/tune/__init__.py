"""Choosing each call's launch configuration: the cost model (perfmodel), the measured autotuner
and its cache (tuner), the hooks that time the real ops for it (profiling) and the command line
`python -m comet.tune` (cli)."""
from comet.tune.cli import main

__all__ = ["main"]
