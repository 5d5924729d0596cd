"""The CUDA buffer's CUDA-graph rules (csrc/include/comet/capture_rule.h), pure functions checked
here without a GPU (docs/gpu.md, "CUDA graphs"): a call launched with a data-segment generation
other than the buffer's is stale, every reallocation makes a new generation, the stale replay's
error names both sizes, and a call on a buffer across nodes is refused while its stream
captures. Their use on the GPU: tests/gpu/test_cuda_graphs.py (written, never run)."""
import pytest

from comet._native import _C

rule = _C.engine


def test_a_launch_is_stale_once_the_segment_was_reallocated():
    g0 = 0
    g1 = rule.next_generation(g0)
    g2 = rule.next_generation(g1)
    assert len({g0, g1, g2}) == 3  # every reallocation is a new generation
    assert not rule.stale_launch(g1, g1)
    assert rule.stale_launch(g0, g1) and rule.stale_launch(g1, g2) and rule.stale_launch(g0, g2)


def test_stale_replay_message_names_both_sizes_and_what_to_do():
    msg = rule.stale_graph_message(64 << 20, 128 << 20)
    assert f"captured before the buffer grew from {64 << 20} to {128 << 20} bytes" in msg, msg
    assert msg.endswith("recapture after reserve()"), msg


@pytest.mark.parametrize("nodes,capturing,refused", [
    (1, False, False), (1, True, False), (2, False, False), (2, True, True), (3, True, True)])
def test_capture_across_nodes_is_refused(nodes, capturing, refused):
    why = rule.capture_refusal(nodes, capturing)
    assert bool(why) == refused, why
    if refused:
        assert f"spans {nodes} nodes cannot be captured in a CUDA graph" in why, why
        assert "proxy" in why, why
