"""comet.plan.ExpertLoad on a GPU: the histogram stays on the device and needs no host sync per
step (written, never run: no GPU here)."""
import torch

from comet.plan import ExpertLoad


def test_expert_load_counts_on_the_device_without_syncing():
    ids = torch.randint(-1, 16, (4096, 4), device="cuda", generator=None)
    load = ExpertLoad(16, device="cuda")
    # a host sync inside update() would raise under "error" sync debug mode
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            load.update(ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = ExpertLoad(16)
    for _ in range(3):
        want.update(ids.cpu())
    assert load.loads() == want.loads()
