"""Python surface of torch.ops.comet.moe_layer0 / moe_layer1: fake kernels for tracing, the
`Layout` of a dispatch, and thin wrappers that pick the buffer and launch configuration and call
one op each. Input validation happens inside the op kernels (so direct torch.ops calls get it too)
and is exchanged between ranks, so a bad input on one rank raises on every rank."""
from __future__ import annotations

import dataclasses

import torch

from comet import symm
from comet._native import _C  # noqa: F401  (registers the ops)

CPU_TILE = (32, 64)


@dataclasses.dataclass
class Layout:
    """Where every row of this rank's dispatch layout came from (output of moe_layer0, input of
    moe_layer1). Rows: by local expert, then source rank in ring order from this rank, then token,
    then slot.

    recv_counts [W, E_local] int32: rows from source rank s for local expert el.
    send_pos    [T, k] int32: position of this rank's slot (t, j) inside its expert's bucket at the
                destination (-1 for dropped slots).
    row_source, row_token, row_slot [M] int32: each row's (source rank, token, slot).
    """

    num_experts: int
    buffer: int
    topk_ids: torch.Tensor
    recv_counts: torch.Tensor
    send_pos: torch.Tensor
    row_source: torch.Tensor
    row_token: torch.Tensor
    row_slot: torch.Tensor

    @property
    def world(self) -> int:
        return self.recv_counts.shape[0]

    @property
    def num_rows(self) -> int:
        return self.row_source.shape[0]

    @property
    def expert_counts(self) -> torch.Tensor:
        """Rows per local expert [E_local]."""
        return self.recv_counts.sum(0)

    @property
    def expert_offsets(self) -> torch.Tensor:
        """[E_local + 1] start row of each local expert."""
        counts = self.expert_counts.to(torch.int64)
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


@torch.library.register_fake("comet::moe_layer0")
def _layer0_fake(x, w0, topk_ids, num_experts, buffer, n_comm, n_gemm, tile_m, tile_n):
    world = symm.world_of_handle(buffer)
    rows = torch.library.get_ctx().new_dynamic_size()
    i32 = dict(dtype=torch.int32, device=x.device)
    return (
        x.new_empty(rows, w0.shape[1]),
        x.new_empty(rows, x.shape[1]),
        torch.empty(world, num_experts // world, **i32),
        torch.empty(topk_ids.shape, **i32),
        torch.empty(rows, **i32),
        torch.empty(rows, **i32),
        torch.empty(rows, **i32),
    )


@torch.library.register_fake("comet::moe_layer1")
def _layer1_fake(h, w1, topk_weights, topk_ids, send_pos, recv_counts, num_experts, buffer,
                 n_comm, n_gemm, tile_m, tile_n):
    return h.new_empty(topk_ids.shape[0], w1.shape[1])


def launch_config(device: torch.device, n_comm: int | None, tile: tuple[int, int] | None):
    """(n_comm, n_gemm, tile_m, tile_n) for a call; explicit arguments win."""
    tile_m, tile_n = tile or CPU_TILE
    return (1 if n_comm is None else int(n_comm)), 1, int(tile_m), int(tile_n)


def _same_device(buf: symm.Buffer, op: int, tensors: dict[str, torch.Tensor]) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            buf.fail_call(op, f"{'comet.moe_layer' + str(op)}: {name} is on {dev} but "
                              f"{next(iter(devices))} is on {first}; all inputs must share a device")
    if first.type == "cuda" and not _C.with_cuda:
        buf.fail_call(op, f"comet.moe_layer{op}: inputs are on {first} but this build of comet has "
                          "no CUDA kernels (rebuild with nvcc available and COMET_CUDA unset)")
    return first


def moe_layer0(x, w0, topk_ids, *, num_experts: int, group=None, n_comm: int | None = None,
               tile: tuple[int, int] | None = None, buffer: symm.Buffer | None = None):
    """Dispatch tokens to their experts' ranks fused with the first expert GEMM.

    x [T, H], w0 [E_local, N0, H], topk_ids [T, k] (int32/int64, -1 = dropped slot).
    Returns (y0 [M, N0] in the dispatch layout, Layout).
    """
    buf = buffer or symm.buffer_for(group)
    device = _same_device(buf, 0, {"x": x, "w0": w0, "topk_ids": topk_ids})
    cfg = launch_config(device, n_comm, tile)
    y0, _a, recv_counts, send_pos, rs, rt, rsl = torch.ops.comet.moe_layer0(
        x, w0, topk_ids, int(num_experts), buf.handle, *cfg)
    return y0, Layout(int(num_experts), buf.handle, topk_ids, recv_counts, send_pos, rs, rt, rsl)


def moe_layer1(h, w1, topk_weights, layout: Layout, *, group=None, n_comm: int | None = None,
               tile: tuple[int, int] | None = None, buffer: symm.Buffer | None = None):
    """Second expert GEMM fused with the weighted top-k reduce and the combine back home.

    h [M, N1] in `layout`'s dispatch layout, w1 [E_local, H, N1], topk_weights [T, k] (float32 or
    h's dtype). Returns out [T, H] on every rank for its own tokens.
    """
    buf = buffer or symm.buffer_for(group)
    if buf.handle != layout.buffer:
        buf.fail_call(1, "comet.moe_layer1: layout was produced on another buffer/group")
    device = _same_device(buf, 1, {"h": h, "w1": w1, "topk_weights": topk_weights,
                                   "topk_ids": layout.topk_ids})
    cfg = launch_config(device, n_comm, tile)
    return torch.ops.comet.moe_layer1(h, w1, topk_weights, layout.topk_ids, layout.send_pos,
                                      layout.recv_counts, layout.num_experts, buf.handle, *cfg)
