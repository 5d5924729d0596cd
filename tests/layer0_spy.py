"""Record what comet.moe_layer0 is called with: (max_rows, rows of y0) per call, for the tests
that check an integration takes the sync-free path (a bound passed, and that many rows back)."""
import contextlib

import comet


@contextlib.contextmanager
def spy_layer0():
    """Within the block, every comet.moe_layer0 call appends (max_rows, y0 rows) to the yielded
    list."""
    seen = []
    real0 = comet.moe_layer0

    def spy(*args, **kwargs):
        y0, layout = real0(*args, **kwargs)
        seen.append((kwargs.get("max_rows"), y0.shape[0]))
        return y0, layout

    comet.moe_layer0 = spy
    try:
        yield seen
    finally:
        comet.moe_layer0 = real0
