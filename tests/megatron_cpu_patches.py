"""Patches that let upstream megatron-core 0.16's own MoELayer run on CPU (gloo): for the tests'
reference only. comet.megatron's CometMoELayer builds and runs on CPU without any of them (it
builds no token dispatcher and carries its own narrow fixes for the router, see comet/megatron.py);
test_megatron.py checks that in processes where this module is never imported.

What upstream assumes a GPU for, and what replaces it here:
* MoEAlltoAllTokenDispatcher creates a class-wide torch.cuda.Stream for its device-to-host copies
  and synchronises through it (_maybe_dtoh_and_synchronize): a placeholder stream, and a CPU
  version that converts the split sizes to numpy as upstream does, without streams.
* moe_utils.RouterGatingLinearFunction tests `te_general_gemm is not None`, a name only defined
  when Transformer Engine imports (NameError without it): defined as None, the torch.mm path
  (importing comet.megatron does the same; repeated here so the reference never depends on it).
* Router.gating moves a CPU router weight to torch.cuda.current_device(), and the all-to-all
  mapping allocates its output on torch.cuda.current_device(): current_device() answers "cpu".
* SharedExpertMLP creates a class-wide torch.cuda.Stream when moe_shared_expert_overlap is set
  (for upstream's dispatcher-side overlap): a placeholder stream (comet.megatron never uses it).
* With expert tensor parallelism the dispatcher all-gathers uneven token chunks over the expert TP
  group and reduce-scatters them back (tensor_parallel.mappings), which gloo lacks (its allgather
  needs equal sizes, it has no reduce_scatter): on CPU tensors, the gather pads each chunk to the
  largest and slices, the reduce-scatter all-reduces and keeps this rank's chunk.
* use_torch_grouped_gemm() (separate, for the GroupedMLP reference): grouped_gemm's gmm in torch.
* Attention forks the CUDA RNG tracker around its dropout (whose states are CUDA generator
  states): fork() does nothing (the tests run without dropout).
"""
from __future__ import annotations

import contextlib

import torch

_applied = False


class _NoStream:
    """Stands in for the dispatcher's class-wide CUDA stream (never used on CPU)."""


def _cpu_dtoh_and_synchronize(self, point, tokens_per_expert=None):
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _cpu_gather_along_first_dim(real):
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if input_.device.type != "cpu" or group.size() == 1:
            return real(input_, group, output_split_sizes, use_global_buffer)
        sizes = output_split_sizes or [input_.shape[0]] * group.size()
        padded = input_.new_zeros((max(sizes),) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        chunks = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(chunks, padded, group=group)
        return torch.cat([c[:n] for c, n in zip(chunks, sizes)])

    return gather


def _cpu_reduce_scatter_along_first_dim(real):
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_.device.type != "cpu" or group.size() == 1:
            return real(input_, group, input_split_sizes, use_global_buffer)
        sizes = input_split_sizes or [input_.shape[0] // group.size()] * group.size()
        total = input_.clone()
        torch.distributed.all_reduce(total, group=group)
        return total.split(sizes)[group.rank()].contiguous()

    return reduce_scatter


def _torch_gmm(a, b, batch_sizes, trans_b=False):
    """grouped_gemm.ops.gmm in plain torch: a's rows split by batch_sizes, each part times its
    expert's b[i] (transposed with trans_b)."""
    parts = [x @ (w.t() if trans_b else w) for x, w in zip(a.split(batch_sizes.tolist()), b)]
    return torch.cat(parts)


def use_torch_grouped_gemm() -> None:
    """Lets upstream's GroupedMLP (the legacy grouped-GEMM experts) build and run without the
    grouped_gemm package, which is not installed here: its gmm in plain torch. For the reference
    only; call before building a GroupedMLP."""
    import types

    from megatron.core.transformer.moe import grouped_gemm_util

    grouped_gemm_util.grouped_gemm = types.SimpleNamespace(
        ops=types.SimpleNamespace(gmm=_torch_gmm))
    grouped_gemm_util.ops = grouped_gemm_util.grouped_gemm.ops


def apply() -> None:
    """Install the patches (idempotent). Call before building Megatron modules."""
    global _applied
    if _applied:
        return
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    torch.cuda.current_device = lambda: torch.device("cpu")
    from megatron.core.tensor_parallel import random as mcore_random

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    if SharedExpertMLP.stream is None:
        SharedExpertMLP.stream = _NoStream()
    mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _cpu_gather_along_first_dim(
        mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _cpu_reduce_scatter_along_first_dim(
        mappings._reduce_scatter_along_first_dim)
    _applied = True
