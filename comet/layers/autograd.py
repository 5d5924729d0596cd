"""Autograd for torch.ops.comet.moe_layer0 / moe_layer1.

Registered with torch.library.register_autograd, so the ops (and the comet.moe_layer0/1 wrappers)
are differentiable in eager mode and under torch.compile. The backward passes reuse the same two
fused operators, so every gradient travels over the same fused comm + GEMM machinery as the forward:

layer0 (y0[row(s,t,j)] = x_s[t] @ W0[e]^T, a = the dispatched rows x_s[t]):
  dx_s[t] = sum_j dy0[row(s,t,j)] @ W0[e_j]      -> moe_layer1(dy0, W0^T, unit weights): the GEMM,
                                                     the top-k reduce and the combine back home.
  dW0[e]  = dy0_e^T @ A_e                        -> A is the `a` output of the forward call, saved:
                                                     it is materialised by the fused kernel anyway,
                                                     and pulling it again would cost a second
                                                     dispatch (all the token traffic of the forward)
                                                     in every backward to save M x H activations.
  (a gradient reaching `a` itself is folded into the same moe_layer1 call: [dy0 | da] against
  [W0^T | I].)

layer1 (out_s[t] = sum_j w[t,j] * h[row] @ W1[e_j]^T):
  g[row]    = dout_s[t] @ W1[e_j]                -> moe_layer0(dout, W1^T): dispatch + GEMM; its `a`
                                                     output is the dispatched dout.
  dh[row]   = w[t,j] * g[row]                    -> the per-row weight w[t,j] is dispatched with a
                                                     "virtual token" moe_layer0 call (one row per
                                                     slot, ids reshaped to [T*k, 1]: the rows
                                                     come out in exactly the real dispatch order;
                                                     the scalar as bf16 pieces, see below).
  dw[t,j]   = <dout_s[t], h[row] @ W1[e_j]^T> = <g[row], h[row]>, computed on the expert's rank
                                                  and sent home with a virtual-token moe_layer1
                                                  call (unit weights and unit 1x1 experts).
  dW1[e]    = (w * dispatched dout)_e^T @ h_e.
Dropped slots (id -1) have no row: they contribute nothing and get exactly zero weight gradient.
Biases: db0[e] / db1[e] are column sums of dy0 / (w * dispatched dout) over the expert's rows, and
dw[t,j] gains <dout[t], b1[e_j]>. Transposed weights need no copy in backward: the dx / dh calls
read the forward's weight in the other layout (w0 [E, N0, H] is layer1's w1 read transposed).
With max_rows, every backward call keeps the forward's bound (padded rows are not read).
Expert tensor parallelism (tp_size t > 1): every backward call keeps the forward's t. dx and
layer1's dw sum the t ranks' partials at home (layer1's tp reduction); dW0 / dW1 / db0 are this
rank's shard; db1 (b1 is added once) is the full gradient on every tp rank (the same value); the
bias term of dw is added by tp rank 0 only; the t partials of dw travel in t separate column
blocks of the virtual-token rows (see _rows_to_slots), so they are summed at home in fp32, in
tp rank order, not in the transport dtype.

Every call backward makes takes only what the CUDA kernels accept (bf16/fp16 activations, fp32
top-k weights, 16-byte rows): proven on the CPU with COMET_CPU_CUDA_RULES=1
(tests/test_cuda_rules.py runs the autograd tests so).

Weight gradients (Lancet): dW0/dW1 depend on nothing the backward communication produces after
them, so they run concurrently with it. In eager mode on the CPU backend each dW GEMM is issued on
a worker thread while the calling thread runs the fused collective (layer0: dW0 || the dx
GEMM+reduce+combine; layer1: dW1 || the return of the weight gradients). On CUDA the worker
follows the caller's stream: at submit an event is recorded on the caller's current stream; the
worker enqueues the GEMM on a dedicated side stream (one per device) that first waits for that
event, its inputs are marked as used there (record_stream), and the result is handed back with an
event the consumer's stream waits for (and record_stream on it): no host synchronisation, and
the GEMM runs on the GPU beside the collective's kernels. A deferred dW computed inline at
compute() waits for the same submit-time event on the stream current then.
`set_weight_grad_overlap(False)` runs them inline (for measurements).

Deferred weight gradients (like Megatron's backward_dw, for pipeline schedules)::

    with comet.layers.autograd.defer_weight_grads() as q:   # active during backward (or forward)
        loss.backward()                               # dx/dh/dweights now, dW recorded in q
    ...                                               # e.g. the next micro-batch's backward
    q.compute()                                       # or compute_deferred_weight_grads()

While a queue is active, backward returns no gradient for w0/w1 and records a closure instead;
`compute()` runs them and accumulates through autograd (`torch.autograd.backward(w, dW)`, so leaf
parameters get `.grad` and hooks fire; a non-leaf weight such as a stacked or cast parameter
propagates further to its leaves). A queue active during the *forward* of an op is remembered by
that op (a layer can own its queue); otherwise the queue active during backward is used.
`defer_weight_grads(background=True)` starts the GEMMs at once on a worker thread and only the
accumulation waits for compute(): the dW of one layer then overlaps the backward communication of
the layers below it.

Under tracing (torch.compile / AOTAutograd / make_fx) backward is traced into a graph: no worker
threads and no deferral there; the weight-gradient GEMM is the opaque op comet::expert_weight_grad.

Collective contract: every rank must run backward through every comet op call it made, in the
same order (as with any collective), and `requires_grad` of x/h/w0/w1/topk_weights must agree
across ranks (it decides which collective calls backward makes; a disagreement raises on every
rank through the ops' call protocol).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading

import torch

from comet.layers import activation as _activation
from comet.layers import ops as _ops  # noqa: F401  (the ops and their fake kernels)
from comet.buffers import symm
from comet.formats import fp8

__all__ = [
    "DeferredWeightGrads",
    "compute_deferred_weight_grads",
    "defer_weight_grads",
    "expert_preactivation",
    "expert_weight_grad",
    "pending_weight_grads",
    "set_weight_grad_overlap",
    "weight_grad_overlap",
]


# --------------------------------------------------------------------------------------------------
# The weight-gradient GEMM: one opaque op, so traced graphs need no data-dependent splits.
# --------------------------------------------------------------------------------------------------
#
# dW[e] = grad_e^T @ inp_e over the rows of local expert e is a grouped GEMM whose reduction
# dimension (the rows M) is split per expert: torch's grouped mm in its "2d x 2d -> 3d" form,
# grad^T [P, M] x inp [M, Q] with `offs` = the experts' cumulative row ends (int32, computed on the
# device from recv_counts: no host sync). On CUDA with bf16 operands on sm90/sm100 that is one
# CUTLASS kernel on the tensor cores, fp32 accumulation, the output rounded once to the operand
# dtype, and no read of the offsets on the host (torch 2.14: fp16, other GPUs and fp32 operands take
# torch's own per-expert fallback, which does read them). torch 2.14 writes the operand dtype only
# (out_dtype must match the operands), so an fp32 out_dtype with 16-bit operands is probed once
# and, while torch refuses it, served by the fixed-order loop below with fp32 output. The autograd
# paths never ask for it on a GPU: the ops take weights in the activation dtype.
#
# Operands: the GEMM runs in the activation dtype. A mix of a 16-bit and an fp32 operand (layer1's
# dW1 takes the fp32 product w * dout against bf16 h) rounds the fp32 one to the 16-bit dtype once,
# as a whole tensor; float64 anywhere (the CPU gradient checks) runs everything in float64.
#
# Order: every expert's rows are reduced by one GEMM of its own (grouped: one problem of the kernel,
# each output tile one block's reduction over all of the expert's rows, as CUTLASS's grouped tile
# scheduler has no split-K; looped: one mm, experts in index order), with no atomics and nothing
# that depends on timing, so the result is bitwise reproducible run to run on the same device and
# path (the grouped kernel and the loop are not bitwise equal to each other). The CPU backend runs the loop (its offsets are
# host memory already) with the operands widened once to the fp32 accumulator: products of 16-bit
# values are exact in fp32, so it sums the same products as the tensor cores, in its own order.

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_ALIGN_BYTES = 16          # torch's grouped mm: 16-byte aligned data and row strides
_wide_grouped_out = None   # whether torch's grouped mm writes fp32 from 16-bit operands (probed)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _operand_dtype(grad: torch.Tensor, inp: torch.Tensor, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype the weight-gradient GEMM reads its operands in (see above)."""
    if torch.float64 in (grad.dtype, inp.dtype, out_dtype):
        return torch.float64
    if grad.dtype == inp.dtype:
        return grad.dtype
    low = [d for d in (grad.dtype, inp.dtype) if d in _LOW_PRECISION]
    if len(low) != 1:
        raise TypeError(f"comet::expert_weight_grad: operands {grad.dtype} and {inp.dtype} "
                        "do not share a GEMM dtype")
    return low[0]


def _expert_row_ends(recv_counts: torch.Tensor) -> torch.Tensor:
    """Cumulative row end of each local expert in the dispatch layout: int32 [E_local], computed
    where recv_counts lives (on a GPU: no host sync)."""
    return recv_counts.sum(0).cumsum(0).to(torch.int32)


def _grouped_mm_fits(grad: torch.Tensor, inp: torch.Tensor) -> bool:
    """torch's grouped mm takes grad^T and inp as they are: 16-byte aligned data and rows (a
    storage's base is aligned further by torch's allocators, so the offset decides)."""
    size = grad.element_size()
    return (hasattr(torch, "_grouped_mm") and grad.is_contiguous() and inp.is_contiguous()
            and all((n * size) % _ALIGN_BYTES == 0 for n in (
                grad.shape[1], inp.shape[1], grad.storage_offset(), inp.storage_offset())))


def _grouped_weight_grad(grad, inp, ends, out_dtype):
    """One grouped GEMM over the local experts, or None where torch refuses out_dtype."""
    global _wide_grouped_out
    wide = out_dtype != grad.dtype
    if wide and _wide_grouped_out is False:
        return None
    try:
        out = torch._grouped_mm(grad.t(), inp, offs=ends, out_dtype=out_dtype)
    except RuntimeError:
        if not wide:
            raise
        _wide_grouped_out = False
        return None
    if wide:
        _wide_grouped_out = True
    # An expert without rows is a group with an empty reduction: torch does not document what the
    # kernel writes there, so it is set to the exact zero the contract promises.
    rows = torch.diff(ends, prepend=ends.new_zeros(1))
    return torch.where((rows > 0).view(-1, 1, 1), out, out.new_zeros(()))


def _looped_weight_grad(grad, inp, ends, out_dtype):
    """The fixed-order fallback: one mm per expert, in index order, into an fp32 (fp64)
    accumulator; the operands are widened once each (on a GPU, 16-bit operands go to the tensor
    cores as they are with an fp32 output)."""
    acc = _acc_dtype(grad.dtype)
    out = torch.zeros(ends.shape[0], grad.shape[1], inp.shape[1], dtype=acc, device=grad.device)
    ends = ends.tolist()  # the CPU backend's counts are host memory; on a GPU: this path syncs
    rows = ends[-1] if ends else 0
    on_tensor_cores = grad.is_cuda and grad.dtype in _LOW_PRECISION
    g, x = grad[:rows], inp[:rows]
    if not on_tensor_cores:
        g, x = g.to(acc), x.to(acc)
    begin = 0
    for el, end in enumerate(ends):
        if end > begin:
            if on_tensor_cores:
                out[el] = torch.mm(g[begin:end].t(), x[begin:end], out_dtype=acc)
            else:
                torch.mm(g[begin:end].t(), x[begin:end], out=out[el])
        begin = end
    return out.to(out_dtype)


@torch.library.custom_op("comet::expert_weight_grad", mutates_args=())
def expert_weight_grad(grad: torch.Tensor, inp: torch.Tensor, recv_counts: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """Per local expert el: ``grad_el^T @ inp_el`` over the expert's rows of the dispatch layout.

    grad [M, P], inp [M, Q] (rows grouped by local expert, ``recv_counts.sum(0)`` rows each, rows
    past their total ignored: a max_rows bound's padding), recv_counts [W, E_local]. Returns
    [E_local, P, Q] in out_dtype: one grouped GEMM in the operands' (activation) dtype with fp32
    accumulation (fp64 for float64). An expert without rows gets zeros. See the notes above."""
    return _weight_grad(grad, inp, recv_counts, out_dtype)


def _weight_grad(grad, inp, recv_counts, out_dtype):
    """expert_weight_grad's body (a plain function: tests run it on fake CUDA tensors)."""
    dtype = _operand_dtype(grad, inp, out_dtype)
    grad, inp = grad.to(dtype).contiguous(), inp.to(dtype).contiguous()
    ends = _expert_row_ends(recv_counts)
    if grad.is_cuda and dtype in _LOW_PRECISION and _grouped_mm_fits(grad, inp):
        out = _grouped_weight_grad(grad, inp, ends, out_dtype)
        if out is not None:
            return out
    return _looped_weight_grad(grad, inp, ends, out_dtype)


@expert_weight_grad.register_fake
def _expert_weight_grad_fake(grad, inp, recv_counts, out_dtype):
    return grad.new_empty(recv_counts.shape[1], grad.shape[1], inp.shape[1], dtype=out_dtype)


# --------------------------------------------------------------------------------------------------
# Overlap and deferral of the weight gradients
# --------------------------------------------------------------------------------------------------

_OVERLAP = os.environ.get("COMET_WGRAD_OVERLAP", "1") != "0"
_pool = None
_pool_lock = threading.Lock()


def set_weight_grad_overlap(enabled: bool) -> None:
    """Run the eager-mode weight-gradient GEMMs on a worker thread concurrently with the backward
    collective (default; env COMET_WGRAD_OVERLAP=0 disables), or inline after it."""
    global _OVERLAP
    _OVERLAP = bool(enabled)


def weight_grad_overlap() -> bool:
    return _OVERLAP


class _Pool:
    """Worker threads for the weight-gradient GEMMs. dW tasks never wait on a peer, so any pool
    size is deadlock-free; ranks simulated as threads of one process share the pool. A task runs
    with the submitting thread's intra-op thread count: OpenMP's setting is per thread, and a
    worker left at the default (every core) would spin against the comm/GEMM blocks."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="comet-wgrad")

    def submit(self, fn):
        threads = torch.get_num_threads()

        def run():
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            return fn()

        return self._pool.submit(run)


_wgrad_streams: dict = {}


def _wgrad_stream(device: torch.device):
    """The side stream of the weight-gradient GEMMs on `device`, one per device for the process
    (a torch.cuda.Stream: never the default stream; the GEMM does not spin, so sharing torch's
    stream pool with other code only orders work, it cannot hang)."""
    with _pool_lock:
        stream = _wgrad_streams.get(device.index)
        if stream is None:
            stream = _wgrad_streams[device.index] = torch.cuda.Stream(device=device)
        return stream


def _cuda_device(tensors) -> torch.device | None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return t.device
    return None


class _Task:
    """fn(), whose inputs were produced on the submitting thread's current stream: on a worker
    thread (background) or when its result is asked for. CPU: fn() as it is. CUDA: the submit's
    stream position is an event; the GEMM is enqueued on the device's wgrad side stream after
    it (worker) or on the consumer's stream after it (inline), with record_stream on the inputs
    and the result, so no stream reads memory another may have reused and nothing waits on the
    host."""

    def __init__(self, fn, inputs=(), background: bool = False):
        self.fn, self.inputs = fn, tuple(t for t in inputs if isinstance(t, torch.Tensor))
        self.device = _cuda_device(self.inputs)
        self.ready = None
        if self.device is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(self.device))
        self.future = _executor().submit(self._on_side) if background else None

    def _enqueue(self, stream):
        """fn() enqueued on `stream` after the submit-time event; returns (result, done event)."""
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(self.ready)
            for t in self.inputs:
                t.record_stream(stream)
            out = self.fn()
            done = torch.cuda.Event()
            done.record(stream)
        return out, done

    def _on_side(self):
        if self.device is None:
            return self.fn()
        return self._enqueue(_wgrad_stream(self.device))

    def result(self):
        if self.device is None:
            return self.future.result() if self.future is not None else self.fn()
        current = torch.cuda.current_stream(self.device)
        if self.future is None:
            return self._enqueue(current)[0]
        out, done = self.future.result()
        current.wait_event(done)
        if isinstance(out, torch.Tensor):
            out.record_stream(current)
        return out

    def cancel(self) -> None:
        if self.future is not None:
            self.future.cancel()


def _executor() -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Pool()
        return _pool


class DeferredWeightGrads:
    """A queue of weight-gradient computations recorded by backward (see the module docstring).

    `compute()` runs (or, with background=True, waits for) them in recording order and
    accumulates each into its weight through autograd; it returns how many it applied."""

    def __init__(self, background: bool = False):
        self.background = bool(background)
        self._items: list = []
        self._lock = threading.Lock()

    def _add(self, weight: torch.Tensor, fn, inputs=()) -> None:
        task = _Task(fn, inputs, background=self.background)
        with self._lock:
            self._items.append((weight, task))
        _local().pending.append(self)

    def __len__(self) -> int:
        return len(self._items)

    def compute(self) -> int:
        with self._lock:
            items, self._items = self._items, []
        for weight, task in items:
            grad = task.result()
            if weight.requires_grad:
                torch.autograd.backward(weight, grad)
        return len(items)

    def clear(self) -> None:
        """Drop the recorded computations without applying them."""
        with self._lock:
            items, self._items = self._items, []
        for _w, task in items:
            task.cancel()


class _Local(threading.local):
    def __init__(self):
        self.active: list[DeferredWeightGrads] = []
        self.pending: list[DeferredWeightGrads] = []


_tls = _Local()


def _local() -> _Local:
    return _tls


@contextlib.contextmanager
def defer_weight_grads(queue: DeferredWeightGrads | None = None, *, background: bool = False):
    """Defer the comet ops' weight gradients into `queue` (a new DeferredWeightGrads unless
    given) while the block runs on this thread; yields the queue."""
    q = queue if queue is not None else DeferredWeightGrads(background=background)
    _tls.active.append(q)
    try:
        yield q
    finally:
        _tls.active.remove(q)


def compute_deferred_weight_grads() -> int:
    """Apply every weight gradient deferred on this thread (all queues); returns the count."""
    n = 0
    while _tls.pending:
        q = _tls.pending.pop(0)
        n += q.compute()
    return n


def pending_weight_grads() -> int:
    """How many deferred weight gradients this thread has not applied yet."""
    return sum(len(q) for q in dict.fromkeys(_tls.pending))


def _active_queue() -> DeferredWeightGrads | None:
    return _tls.active[-1] if _tls.active else None


def _tracing(*tensors) -> bool:
    """True while backward is being traced into a graph (no threads, no deferral then)."""
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if get_proxy_mode() is not None or torch._guards.detect_fake_mode() is not None:
        return True
    return any(isinstance(t, (FakeTensor, FunctionalTensor)) for t in tensors if t is not None)


class _WeightGrad:
    """One dW computation of a backward call: deferred into a queue, started on a worker thread
    (to overlap the collective that follows), or run inline."""

    def __init__(self, ctx, weight: torch.Tensor, fn, traced: bool, inputs=()):
        self.value = None
        self.task = None
        queue = None
        if not traced:
            queue = getattr(ctx, "wgrad_queue", None)
            if queue is None:
                queue = _active_queue()
        if queue is not None:
            queue._add(weight, fn, inputs)
        elif _OVERLAP and not traced:
            self.task = _Task(fn, inputs, background=True)
        else:
            self.value = fn()

    def result(self):
        return self.task.result() if self.task is not None else self.value


# --------------------------------------------------------------------------------------------------
# Virtual-token helpers: per-slot scalars over the same fused ops
# --------------------------------------------------------------------------------------------------
#
# A per-slot scalar (a top-k weight, its gradient) travels as a "virtual token": a row of its own
# through a moe_layer0 / moe_layer1 call with identity experts, so it comes out in exactly the
# dispatch layout (or lands on its home slot). The row must be something the CUDA kernels take:
# 8 elements (16 bytes, their vector width) of bfloat16. An fp32 scalar goes as three bf16 pieces
# hi + mid + lo (each the bf16 rounding of what the previous ones left): 3 x 8 significant bits
# hold fp32's 24, and bf16 has fp32's exponent range, so the sum of the pieces is the value
# exactly. Identity experts move every piece unchanged (x * 1 summed with zeros in fp32, then
# rounded to bf16, which it already is), and layer1's single unit-weighted slot per virtual token
# is one exact partial. Exact for 0 and 2^-100 <= |v| <= 2^127 (tests/test_cuda_rules.py); a
# value under ~2^-110 loses bits below bf16's subnormal step 2^-133. float64 scalars (CPU
# gradient checks) travel as float64 rows instead.

VT_WIDTH = 8
VT_PIECES = 3


def encode_scalars(values: torch.Tensor) -> torch.Tensor:
    """[n] fp32/fp64 -> [n, VT_WIDTH] transport rows (bf16 pieces, or float64 as itself)."""
    n = values.shape[0]
    if values.dtype == torch.float64:
        rows = values.new_zeros(n, VT_WIDTH)
        rows[:, 0] = values
        return rows
    rows = values.new_zeros(n, VT_WIDTH, dtype=torch.bfloat16)
    rest = values.float()
    for i in range(VT_PIECES):
        piece = rest.to(torch.bfloat16)
        rows[:, i] = piece
        rest = rest - piece.float()
    return rows


def decode_scalars(rows: torch.Tensor) -> torch.Tensor:
    """[n, VT_WIDTH] transport rows -> [n] (float64 or float32), inverse of encode_scalars."""
    if rows.dtype == torch.float64:
        return rows[:, 0]
    p = rows[:, :VT_PIECES].float()
    return (p[:, 0] + p[:, 1]) + p[:, 2]


def _identity_experts(experts_local, rows, width=VT_WIDTH):
    return torch.eye(width, dtype=rows.dtype, device=rows.device).expand(
        experts_local, width, width).contiguous()


def _slots_to_rows(values, topk_ids, experts_local, num_experts, buffer, cfg, max_rows=-1,
                   tp=1):
    """values [T, k] on the source rank -> [M] on the destination ([max_rows] with a bound), in
    the dispatch layout of topk_ids (a moe_layer0 call with every (t, j) as its own token)."""
    T, k = topk_ids.shape
    v = torch.where(topk_ids >= 0, values, torch.zeros_like(values)).reshape(T * k)
    enc = encode_scalars(v)
    rows = torch.ops.comet.moe_layer0(enc, _identity_experts(experts_local, enc),
                                      topk_ids.reshape(T * k, 1), num_experts, buffer, *cfg,
                                      None, False, max_rows, tp)[0]
    return decode_scalars(rows)


def _rows_to_slots(rows, topk_ids, send_pos, recv_counts, num_experts, buffer, cfg, max_rows=-1,
                   band_n=1, tp=1, tp_rank=0):
    """rows [M] ([max_rows]) in the dispatch layout of topk_ids -> [T, k] on each row's home rank
    (a moe_layer1 call over the virtual-token layout with unit weights, in bands of band_n
    n-tiles); dropped slots get 0.

    With tp > 1 each row is this tp rank's partial and the result their sum: tp rank r's pieces
    go in column block r of a [M, VT_WIDTH * tp] row (zeros elsewhere), so layer1's combine adds
    only exact zeros to each piece, and the t decoded partials are summed here in fp32 (fp64),
    ascending tp rank: a fixed order, and no rounding of a partial sum to the transport dtype."""
    T, k = topk_ids.shape
    enc = encode_scalars(rows)
    if tp > 1:
        wide = enc.new_zeros(enc.shape[0], VT_WIDTH * tp)
        wide[:, VT_WIDTH * tp_rank:VT_WIDTH * (tp_rank + 1)] = enc
        enc = wide
    unit = torch.ones(T * k, 1, dtype=torch.float32, device=rows.device)
    out = torch.ops.comet.moe_layer1(enc, _identity_experts(recv_counts.shape[1], enc,
                                                            enc.shape[1]), unit,
                                     topk_ids.reshape(T * k, 1), send_pos.reshape(T * k, 1),
                                     recv_counts, num_experts, buffer, *cfg, None, False,
                                     max_rows, band_n, tp)
    total = decode_scalars(out[:, :VT_WIDTH])
    for r in range(1, tp):
        total = total + decode_scalars(out[:, VT_WIDTH * r:VT_WIDTH * (r + 1)].contiguous())
    out = total.reshape(T, k)
    return torch.where(topk_ids >= 0, out, torch.zeros_like(out))


def _expert_bias_grad(grad, recv_counts, out_dtype):
    """Per local expert, the sum of grad's rows [M, P] of that expert: [E_local, P].

    The same grouped GEMM against a column of ones, in the bias's dtype where that is 16-bit (so
    layer1's fp32 w * dout is read in the activation dtype, as for dW1), widened to 16 bytes of
    ones so that torch's grouped kernel takes it (a few columns more of a GEMM whose reduction is
    already the whole of grad)."""
    dtype = out_dtype if out_dtype in _LOW_PRECISION else grad.dtype
    ones = grad.new_ones(grad.shape[0], _ALIGN_BYTES // dtype.itemsize, dtype=dtype)
    return expert_weight_grad(grad, ones, recv_counts, out_dtype)[:, :, 0].contiguous()


def _row_experts(recv_counts, rows):
    """Local expert of each of `rows` rows of the dispatch layout (rows past M: expert 0)."""
    counts = recv_counts.sum(0).to(torch.int64)
    el = torch.arange(counts.shape[0], device=recv_counts.device)
    e = torch.repeat_interleave(el, counts)
    return torch.cat([e, e.new_zeros(rows - e.shape[0])]) if rows > e.shape[0] else e


def _needs(ctx, *positions):
    """needs_input_grad at these input positions (a call that left the trailing optional
    arguments out has fewer entries: those inputs need nothing)."""
    n = ctx.needs_input_grad
    return tuple(i < len(n) and bool(n[i]) for i in positions)


def _grads(ctx, grads: dict):
    """One gradient per input of the call (None where not given)."""
    return tuple(grads.get(i) for i in range(len(ctx.needs_input_grad)))


# --------------------------------------------------------------------------------------------------
# layer0
# --------------------------------------------------------------------------------------------------


# FP8 (comet.fp8): forward in FP8, backward in bf16. The FP8 inputs a call saved (x's dispatched
# rows as packed FP8 rows, FP8 weights) are dequantised to the backward's dtype, the activation's
# (bfloat16 for an FP8 activation), and the backward runs the 16-bit formulas above on them. The
# gradient of an FP8 input is computed in that dtype too (torch then casts it to the input's own
# dtype: train through comet.fp8.moe_layer0/1, whose bf16 master weights get it in bf16).

_FP8 = torch.float8_e4m3fn


def _backward_dtype(act: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if act.dtype == _FP8 else act.dtype


def _dequantized_weight(w, scale, dtype):
    return fp8.dequantize_blocks(w, scale, dtype) if w.dtype == _FP8 else w


def arg(op, inputs, name):
    """The argument `name` of a call of `op` (setup_context's inputs are every argument of the
    schema, in its order): by name, so that arguments added to the schema move nothing here."""
    names = _ARG_NAMES.get(op)
    if names is None:
        schema = getattr(torch.ops.comet, op).default._schema
        names = _ARG_NAMES[op] = {a.name: i for i, a in enumerate(schema.arguments)}
    return inputs[names[name]]


_ARG_NAMES: dict = {}


def _layer0_setup_context(ctx, inputs, output):
    (x, w0, topk_ids, num_experts, buffer, n_comm, n_gemm, tile_m, tile_n, b0, w0_transposed,
     max_rows) = inputs[:12]
    w0_scale = arg("moe_layer0", inputs, "w0_scale")
    dispatch_fp8 = arg("moe_layer0", inputs, "dispatch_fp8")
    _y0, a, recv_counts, send_pos, _rs, _rt, _rsl = output
    ctx.set_materialize_grads(False)
    ctx.cfg = (int(num_experts), int(buffer), (n_comm, n_gemm, tile_m, tile_n))
    ctx.tp = int(arg("moe_layer0", inputs, "tp_size"))
    ctx.w0_transposed, ctx.max_rows = bool(w0_transposed), int(max_rows)
    ctx.x_dtype = _backward_dtype(x)
    ctx.fp8_rows = x.dtype == _FP8 or bool(dispatch_fp8)  # `a` holds packed FP8 rows
    ctx.hidden = x.shape[1]
    ctx.b0_dtype = None if b0 is None else b0.dtype
    ctx.wgrad_queue = _active_queue()
    ctx.activation = arg("moe_layer0", inputs, "activation")
    ctx.save_for_backward(w0, topk_ids, a, recv_counts, send_pos, w0_scale,
                          b0 if ctx.activation else None)


@torch.library.custom_op("comet::expert_preactivation", mutates_args=())
def expert_preactivation(a: torch.Tensor, w0: torch.Tensor, b0: torch.Tensor | None,
                         recv_counts: torch.Tensor, w0_transposed: bool) -> torch.Tensor:
    """The fused activation's input, recomputed for backward: [rows, N0] = a_e @ w0[e]^T + b0[e]
    per local expert over the dispatch layout's rows, in fp32 (fp64) from the widened operands
    (rows past M: zero). One GEMM of the forward's size and no communication (docs/design.md,
    "The fused activation"); an opaque op, so traced backward graphs need no data-dependent
    split."""
    return _expert_preactivation(a, w0, b0, recv_counts, w0_transposed)


@expert_preactivation.register_fake
def _expert_preactivation_fake(a, w0, b0, recv_counts, w0_transposed):
    return a.new_empty(a.shape[0], w0.shape[2 if w0_transposed else 1],
                       dtype=_acc_dtype(a.dtype))


def _expert_preactivation(a, w0, b0, recv_counts, w0_t):
    """expert_preactivation's body: a loop over the local experts (their row counts read on the
    host)."""
    acc = _acc_dtype(a.dtype)
    n0 = w0.shape[2] if w0_t else w0.shape[1]
    out = torch.zeros(a.shape[0], n0, dtype=acc, device=a.device)
    begin = 0
    for el, n in enumerate(recv_counts.sum(0).tolist()):  # host memory on the CPU backend
        if n:
            w = w0[el].to(acc)
            out[begin:begin + n] = a[begin:begin + n].to(acc) @ (w if w0_t else w.t())
            if b0 is not None:
                out[begin:begin + n] += b0[el].to(acc)
        begin += n
    return out


def _layer0_backward(ctx, dy0, da, *_int_grads):
    w0, topk_ids, a, recv_counts, send_pos, w0_scale, b0 = ctx.saved_tensors
    w0 = _dequantized_weight(w0, w0_scale, ctx.x_dtype)
    if ctx.fp8_rows:
        a = fp8.dequantize_rows(*fp8.unpack_rows(a, ctx.hidden), ctx.x_dtype)
        da = None  # the packed rows are not differentiable (a gradient there has no meaning)
    num_experts, buffer, cfg = ctx.cfg
    w0_t, max_rows = ctx.w0_transposed, ctx.max_rows
    need_x, need_w0, need_b0 = _needs(ctx, 0, 1, 9)
    el = w0.shape[0]
    n0, hidden = (w0.shape[2], w0.shape[1]) if w0_t else (w0.shape[1], w0.shape[2])
    if dy0 is None:
        dy0 = a.new_zeros(a.shape[0], n0)
    elif ctx.activation:  # dy0 is dh: through the activation at the recomputed pre-activation
        dy0 = _activation.backward(ctx.activation,
                                   expert_preactivation(a, w0, b0, recv_counts, w0_t), dy0)
    dy0 = dy0.to(ctx.x_dtype).contiguous()
    traced = _tracing(dy0, a, w0)

    dw0 = None
    if need_w0:  # independent of the collective below: runs while it communicates
        # dW0 in w0's own layout: [E_local, N0, H] = dy0^T a, or [E_local, H, N0] = a^T dy0
        ops = (a, dy0) if w0_t else (dy0, a)
        dw0 = _WeightGrad(ctx, w0, lambda: expert_weight_grad(*ops, recv_counts, w0.dtype),
                          traced, inputs=(*ops, recv_counts))
    db0 = _expert_bias_grad(dy0, recv_counts, ctx.b0_dtype) if need_b0 else None
    dx = None
    if need_x:
        T, k = topk_ids.shape
        unit = torch.ones(T, k, dtype=torch.float32, device=dy0.device)
        # dx[t] = sum_j dy0[row] @ W0[e_j]: moe_layer1 with w0 as its [E_local, H, N1=N0] weight,
        # which is w0 itself read transposed (no copy) or, for w0_transposed, w0 as it is.
        h, w, w_t = dy0, w0, not w0_t
        if da is not None:  # a = dispatched x: its gradient goes home with the same call
            eye = torch.eye(hidden, dtype=w0.dtype, device=w0.device).expand(el, hidden, hidden)
            h = torch.cat([dy0, da.to(dy0.dtype)], dim=1)
            w = torch.cat([w0 if w0_t else w0.transpose(1, 2), eye], dim=2)
            w_t = False
        dx = torch.ops.comet.moe_layer1(h.contiguous(), w.contiguous(), unit, topk_ids, send_pos,
                                        recv_counts, num_experts, buffer, *cfg, None, w_t,
                                        max_rows, 1, ctx.tp)
    return _grads(ctx, {0: dx, 1: None if dw0 is None else dw0.result(), 9: db0})


# --------------------------------------------------------------------------------------------------
# layer1
# --------------------------------------------------------------------------------------------------


def _layer1_setup_context(ctx, inputs, output):
    (h, w1, topk_weights, topk_ids, send_pos, recv_counts, num_experts, buffer, n_comm, n_gemm,
     tile_m, tile_n, b1, w1_transposed, max_rows, band) = inputs[:16]
    h_scale, w1_scale = (arg("moe_layer1", inputs, n) for n in ("h_scale", "w1_scale"))
    ctx.set_materialize_grads(False)
    ctx.cfg = (int(num_experts), int(buffer), (n_comm, n_gemm, tile_m, tile_n))
    ctx.w1_transposed, ctx.max_rows = bool(w1_transposed), int(max_rows)
    ctx.band_n = int(band)  # backward's layer1 call runs in the forward's bands
    ctx.tp = int(arg("moe_layer1", inputs, "tp_size"))
    ctx.tp_rank = symm.rank_of_handle(buffer) % ctx.tp if ctx.tp > 1 else 0
    ctx.wgrad_queue = _active_queue()
    ctx.save_for_backward(h, w1, topk_weights, topk_ids, send_pos, recv_counts, b1, h_scale,
                          w1_scale)


def _layer1_backward(ctx, dout):
    h, w1, topk_weights, topk_ids, send_pos, recv_counts, b1, h_scale, w1_scale = ctx.saved_tensors
    if h.dtype == _FP8:
        h = fp8.dequantize_rows(h, h_scale, torch.bfloat16)
    w1 = _dequantized_weight(w1, w1_scale, h.dtype)
    num_experts, buffer, cfg = ctx.cfg
    w1_t, max_rows = ctx.w1_transposed, ctx.max_rows
    need_h, need_w1, need_w, need_b1 = _needs(ctx, 0, 1, 2, 12)
    if not (need_h or need_w1 or need_w or need_b1):
        return _grads(ctx, {})
    T = topk_ids.shape[0]
    el = w1.shape[0]
    hidden = w1.shape[2] if w1_t else w1.shape[1]
    acc = _acc_dtype(h.dtype)
    sdt = torch.float64 if torch.float64 in (h.dtype, topk_weights.dtype) else torch.float32
    if dout is None:
        dout = h.new_zeros(T, hidden)
    dout = dout.to(h.dtype).contiguous()
    traced = _tracing(dout, h, w1)

    # g[row] = dout[t] @ W1[e]: moe_layer0 with w1 as its [E_local, N0=N1, H] weight (w1 read
    # transposed, no copy; w1_transposed: as it is); a_d = the dispatched dout rows.
    g, a_d, *_ = torch.ops.comet.moe_layer0(dout, w1, topk_ids, num_experts, buffer, *cfg, None,
                                             not w1_t, max_rows, ctx.tp)
    gf = g.to(acc)
    dh = dw1 = dweights = db1 = None
    if need_h or need_w1 or need_b1:
        row_w = _slots_to_rows(topk_weights.to(sdt), topk_ids, el, num_experts, buffer, cfg,
                               max_rows, ctx.tp)
        row_w = row_w.to(acc).unsqueeze(1)
        wd = a_d.to(acc) * row_w  # the weighted dispatched dout: d(h @ W1^T + b1) per row
        if need_w1:  # dW1 while the weight gradients travel home; in w1's own layout
            ops = (h, wd) if w1_t else (wd, h)
            dw1 = _WeightGrad(ctx, w1, lambda: expert_weight_grad(*ops, recv_counts, w1.dtype),
                              traced, inputs=(*ops, recv_counts))
        if need_b1:
            db1 = _expert_bias_grad(wd, recv_counts, b1.dtype)
        if need_h:
            dh = (gf * row_w).to(h.dtype)
    if need_w:
        drow = (gf * h.to(acc)).sum(1)
        if b1 is not None and ctx.tp_rank == 0:  # d out / d w[t, j] has <dout[t], b1[e_j]>
            # (once: b1 is added by tp rank 0 only)
            drow = drow + (a_d.to(acc) * b1.to(acc)[_row_experts(recv_counts, a_d.shape[0])]).sum(1)
        dweights = _rows_to_slots(drow.to(sdt), topk_ids, send_pos, recv_counts, num_experts,
                                  buffer, cfg, max_rows, ctx.band_n, ctx.tp, ctx.tp_rank)
        dweights = dweights.to(topk_weights.dtype)
    return _grads(ctx, {0: dh, 1: None if dw1 is None else dw1.result(), 2: dweights, 12: db1})


torch.library.register_autograd("comet::moe_layer0", _layer0_backward,
                                setup_context=_layer0_setup_context)
torch.library.register_autograd("comet::moe_layer1", _layer1_backward,
                                setup_context=_layer1_setup_context)
