"""The small-batch tile on the CPU backend: the CUDA kernels' two tile shapes, 64 x 128 and
128 x 128, give the same bits on the op suites' awkward cases (the reduction over K and the
top-k order per row do not depend on how rows are cut into m-tiles), and match the reference.

The cases put more than 64 and more than 128 rows on some experts (skewed routing), none on
others, leave a rank empty, drop slots, and use odd H / N and expert counts that are not powers of
two, so the 64-row plan cuts experts the 128-row plan keeps whole and vice versa."""
import pytest
import torch

from tests.cases import Case
from tests.test_ops_sim import check_against_reference, run_layers

TILES = ((128, 128), (64, 128))
CASES = [
    # ~70% of 111 tokens x 4 slots to expert 0: ~300 rows (3 x 128-row, 5 x 64-row m-tiles)
    Case("skewed-300-rows-w3", 3, 6, 4, (70, 0, 41), hidden=37, n0=30, n1=17, routing="skewed",
         seed=11),
    # E = 10 on 2 ranks, a third of the slots dropped: 60-100 rows per expert
    Case("dropped-e10-w2", 2, 10, 3, (150, 133), hidden=20, n0=18, n1=9, routing="dropped",
         seed=12),
    # E = 12 on 4 ranks, one empty rank, 65 tokens on another: about 20-40 rows per expert
    Case("uniform-e12-w4", 4, 12, 3, (40, 0, 65, 3), hidden=24, n0=20, n1=12, seed=13),
    # every slot to the last expert: 66 rows there (one 128-row tile, two 64-row ones), none on
    # the other eleven
    Case("one-expert-66-rows-w4", 4, 12, 2, (30, 0, 2, 1), routing="one_expert", seed=14),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_64_row_tiles_match_128_row_tiles_bitwise(case, dtype):
    base, inputs = run_layers(case, dtype, 2, 2, TILES[0])
    small, _ = run_layers(case, dtype, 2, 2, TILES[1], inputs=inputs)
    check_against_reference(case, dtype, small, inputs)
    for r, (a, b) in enumerate(zip(base, small)):
        assert torch.equal(a[0], b[0]), f"rank {r}: y0 differs between 128- and 64-row tiles"
        assert torch.equal(a[3], b[3]), f"rank {r}: out differs between 128- and 64-row tiles"


def test_the_cases_put_rows_past_both_tiles():
    """At least one expert of the cases spans several 128-row m-tiles and one lies between 64 and
    128 rows, so the two plans differ (else the test above could not fail on a plan bug)."""
    from tests.cases import make_inputs

    counts = []
    for case in CASES:
        _, _, _, ids, _ = make_inputs(case)
        every = torch.cat([i.flatten() for i in ids])
        counts += [int((every == e).sum()) for e in range(case.experts)]
    assert max(counts) > 256 and any(64 < c <= 128 for c in counts) and 0 in counts
