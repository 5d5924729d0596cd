"""Comet's fused ops inside megatron-core's MoE layer (optional: needs megatron-core, e.g.
``pip install megatron-core==0.16.1``).

``CometMoELayer`` is a ``megatron.core.transformer.moe.moe_layer.MoELayer`` that keeps everything
Megatron's layer owns -- the router (TopKRouter with its score function, group-limited routing,
token dropping, aux/z losses, expert bias), the expert modules and their parameters (so state
dicts and checkpoints are unchanged), the shared experts module -- and replaces only the data path:

    Megatron                         CometMoELayer
    route                            route (Megatron's router: probs [T, E], routing_map [T, E])
    preprocess  (permute 1)          routing_map/probs -> topk_ids [T, k] (-1 = dropped), weights
    shared experts (before routing)  deferred: only the input is kept (and, on CUDA, an event)
    dispatch    (all-to-all)         comet.moe_layer0: dispatch fused with the fc1 GEMM (and
                                     the activation in its epilogue where comet fuses it:
                                     Megatron's F.silu / F.gelu, GLU or not, no clamp or offset)
    routed_experts_compute           shared experts issued (CUDA: on a side stream, overlapping
                                     the routed kernels), then the activation when not fused
                                     (TE's, or GLU / SwiGLU with clamp or offset as configured)
    combine     (all-to-all)         comet.moe_layer1: fc2 GEMM + weighted top-k reduce + combine
    postprocess (unpermute)          reshape, + shared experts' output

The probabilities are applied in layer1's fp32 reduce (Megatron's experts apply them after the
activation, before fc2: the same function, fc2 being linear and bias-free). Gradients flow to the
router through the weights (comet.layers.autograd), so the aux-loss and z-loss machinery attached to
Megatron's probs keeps working.

Expert weights are read from Megatron's own expert module on every forward, whichever it is:
SequentialMLP (local_experts[i].linear_fc1/fc2.weight), GroupedMLP (weight1/weight2 in
Megatron's grouped-GEMM layout) or TEGroupedMLP (linear_fc1/fc2.weight{i}); a checkpoint of
Megatron's layer loads unchanged. SequentialMLP / TEGroupedMLP weights are stacked once per forward
(dispatch and combine share the stack), and kept between forwards (``cache_expert_weights``,
default True) until the parameters may have changed: the cache's key holds each parameter's
identity, storage and autograd version counter (bumped by any in-place write through the
parameter: load_state_dict, a plain torch optimizer) and the number of optimizer steps taken in
this process (a torch.optim step post-hook, counted for every optimizer). The step count is what
sees megatron-core 0.16.1's mixed-precision and distributed optimizers: they write the model
parameters through ``param.data`` (optimizer.py, distrib_optimizer.py), which no version counter
sees, right after their inner torch optimizer's step, so the next forward stacks again. Writes
through ``.data`` outside any optimizer step (a hand-written EMA, say) are invisible to both:
pass ``cache_expert_weights=False`` then.

What is built: everything MoELayer.__init__ builds (router, experts, shared experts) except the
token dispatcher, which Comet never uses (and whose alltoall flavour creates a class-wide CUDA
stream); ``token_dispatcher`` is None. With moe_shared_expert_overlap set, the shared experts are
built as without it (upstream's overlap variant creates a class-wide CUDA stream for the dispatcher
side overlap, unused here).

Upstream fixes carried (megatron-core 0.16.1, applied only where upstream itself fails):
* moe_utils.te_general_gemm is defined as None when Transformer Engine is absent: upstream imports
  the name only with TE, yet its router gating tests ``te_general_gemm is not None``, a NameError on
  every router forward without TE (GPU or CPU, Megatron's own layer too). None selects upstream's
  own torch path; nothing changes where TE is installed. Set at import of comet.megatron.
* On a machine without CUDA, the layer's router computes its gating with upstream's own
  router_gating_linear in place: upstream's Router.gating moves a CPU router weight to
  torch.cuda.current_device() on every call, which raises there. Only that router instance is
  changed, and only when torch.cuda.is_available() is False.
Still upstream's on CPU: the router's expert-bias and global-aux-loss buffers
(moe_router_enable_expert_bias, a global aux loss) are allocated on torch.cuda.current_device() at
construction, so those options need a GPU.

``comet_moe_spec(spec)`` switches a layer or block spec (e.g. from get_gpt_layer_local_spec,
get_gpt_layer_with_transformer_engine_spec or get_gpt_decoder_block_spec) to CometMoELayer, so a
GPTModel built from it uses Comet in every MoE layer.

Shared experts (config.moe_shared_expert_intermediate_size, optional moe_shared_expert_gate) are
Megatron's own SharedExpertMLP, computed between dispatch and combine (with Megatron's selective
recompute of "shared_experts" if configured). config.moe_shared_expert_overlap is accepted and
changes nothing: Comet always overlaps them (Megatron's version of that overlap lives in its token
dispatcher, which Comet does not use).

Deferred weight gradients: with ``delay_wgrad=True`` (default: config.delay_wgrad_compute) the
expert weight gradients of a backward are recorded and applied by ``backward_dw()``, as Megatron's
schedules expect (comet.layers.autograd.defer_weight_grads).

Sync-free path: with config.moe_expert_capacity_factor set, Megatron's router drops every slot
beyond an expert's capacity C = get_capacity(T k, E, factor) on each rank, which bounds the rows a
rank receives; layer0 gets max_rows = comet.nn.worst_case_rows(T, k, E, W, C, tp_size=t) (W the
layer's group, t its expert tensor parallelism; static shapes, no host synchronisation on CUDA).
As in Megatron, every rank of that group feeds the same T tokens per call. A ``max_rows``
argument overrides it (an int, comet.nn.WORST_CASE for the bound without dropping, or -1 for the
dynamic path).

Expert tensor parallelism (config.expert_tensor_parallel_size t > 1): the ops run with
tp_size=t on Megatron's expert tensor-and-model-parallel group (pg_collection.tp_ep), required
TP-innermost (checked: see _comet_group). Megatron's expert modules hold tp shards already --
linear_fc1 column-parallel with each rank's gate and up shards side by side ([2F/t, H] per expert,
GroupedMLP's weight1 [H, E_local * 2F/t] the same per expert), linear_fc2 row-parallel ([H, F/t]) --
which is exactly comet's w0 / w1 shard layout, so they are read as without ETP. Each rank brings
its own tokens (upstream's alltoall dispatcher too: EP all-to-all, then an all-gather over the
expert TP group and a reduce-scatter back); layer1 returns the full sum over the t shards, so no
reduce is added here.

Attention tensor parallelism (tensor_model_parallel_size > 1) needs nothing of the layer: with
sequence parallelism (which Megatron's MoELayer requires in training) each rank's MoE input is its
own slice of the sequence, i.e. its own tokens, exactly as comet's ops take them; the router and
the shared experts are Megatron's own (their sequence-parallel gathers included). Without sequence
parallelism (inference) the t ranks of an attention TP group bring the same tokens, and each gets
its own full result back (as upstream's dispatcher does, t-fold traffic).

Not supported (rejected at construction): MoE latent projections, padding expert inputs to
capacity, router padding for quantization, FP8/FP4, biases in the experts, probs applied on the
input.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import types

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

try:
    from megatron.core import utils as mcore_utils
    from megatron.core.transformer.moe import moe_layer as _mcore_moe_layer
    from megatron.core.transformer.moe import moe_utils as _mcore_moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import (get_capacity, get_default_pg_collection,
                                                         router_gating_linear)
    from megatron.core.transformer.spec_utils import ModuleSpec
except ImportError as e:  # an optional dependency: say which extra brings it
    raise ImportError(
        "comet.megatron needs megatron-core 0.16.1 (the 'megatron' extra): pip install "
        "--no-build-isolation -e '.[megatron]' in this checkout, or pip install "
        f"'comet-moe[megatron]' (make setup installs it too); the import failed with: {e}") from e

import comet
from comet.layers import autograd as cag
from comet import nn as comet_nn
from comet.layers import sidestream

# Optimizer steps taken in this process (every torch.optim optimizer, Megatron's inner ones
# included): part of the stacked-weight cache's key, because Megatron's optimizers then write the
# model parameters through .data, which no version counter sees.
_OPTIMIZER_STEPS = [0]


def _count_optimizer_step(_optimizer, _args, _kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


register_optimizer_step_post_hook(_count_optimizer_step)

__all__ = ["CometMoELayer", "comet_moe_spec", "expert_weights", "routing_to_topk"]

# megatron-core 0.16.1 bug (see the module docstring): without Transformer Engine, moe_utils lacks
# te_general_gemm, which RouterGatingLinearFunction reads -> NameError. None = upstream's torch path.
if not hasattr(_mcore_moe_utils, "te_general_gemm"):
    _mcore_moe_utils.te_general_gemm = None

# The names MoELayer.__init__ builds its token dispatcher from (module globals of moe_layer.py)
_DISPATCHER_NAMES = ("MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher",
                     "MoEFlexTokenDispatcher")
_DISPATCHER_LOCK = threading.Lock()


class _NoTokenDispatcher:
    """Built by MoELayer.__init__ in place of upstream's token dispatcher for a CometMoELayer:
    takes the dispatcher's arguments and builds nothing (set_shared_experts is its only other use
    during construction)."""

    def __init__(self, *args, **kwargs):
        pass

    def set_shared_experts(self, shared_experts):
        pass


@contextlib.contextmanager
def _without_token_dispatcher():
    """MoELayer.__init__ picks its dispatcher class by config.moe_token_dispatcher_type from
    moe_layer's module globals; swap them for _NoTokenDispatcher while it runs (the only way to
    reuse upstream's constructor for everything else). Unknown types still get upstream's error.
    Another thread building an upstream MoELayer at the same moment would see the swap: don't."""
    with _DISPATCHER_LOCK:
        saved = {name: getattr(_mcore_moe_layer, name) for name in _DISPATCHER_NAMES}
        try:
            for name in _DISPATCHER_NAMES:
                setattr(_mcore_moe_layer, name, _NoTokenDispatcher)
            yield
        finally:
            for name, cls in saved.items():
                setattr(_mcore_moe_layer, name, cls)


def _gating_without_cuda(router, input):
    """Router.gating of megatron-core 0.16.1 minus its move of a CPU weight to
    torch.cuda.current_device() (which raises without CUDA): the same router dtype choice and the
    same upstream router_gating_linear."""
    router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
        router.config.moe_router_dtype, input.dtype)
    return router_gating_linear(input, router.weight, router.bias, router_dtype)


def routing_to_topk(probs: torch.Tensor, routing_map: torch.Tensor, topk: int):
    """Megatron's router output -> comet's routing.

    probs [T, E] (router probabilities, zero off the routing map), routing_map [T, E] bool ->
    (topk_ids int64 [T, topk], topk_weights [T, topk] in probs' dtype). A token's selected experts
    come in ascending id order; slots beyond its selected count (tokens dropped by capacity) are
    -1 with weight 0. The weights are gathered from probs, so gradients reach the router."""
    k = min(int(topk), routing_map.shape[1])
    selected, ids = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True)
    ids, valid = ids[:, :k], selected[:, :k] > 0
    weights = probs.gather(1, ids)
    weights = torch.where(valid, weights, torch.zeros_like(weights))
    ids = torch.where(valid, ids, torch.full_like(ids, -1))
    return ids, weights


def expert_weights(experts, num_local_experts: int, hidden_size: int):
    """(w0, w1, transposed) from Megatron's expert module: differentiable views/stacks of its
    parameters (gradients land on them), w0 [E_local, N0, H] and w1 [E_local, H, N1], or with
    transposed=True w0 [E_local, H, N0] and w1 [E_local, N1, H] (GroupedMLP's own storage, read
    by the ops as it is: no copy)."""
    el = num_local_experts
    if hasattr(experts, "local_experts"):  # SequentialMLP
        w0 = torch.stack([e.linear_fc1.weight for e in experts.local_experts])
        w1 = torch.stack([e.linear_fc2.weight for e in experts.local_experts])
    elif hasattr(experts, "weight1") and hasattr(experts, "weight2"):  # GroupedMLP (grouped_gemm)
        # weight1 [H, E_local * N0] and weight2 [E_local * N1, H]: views, no copy
        return (experts.weight1.view(el, hidden_size, -1),
                experts.weight2.view(el, -1, hidden_size), True)
    elif hasattr(experts, "linear_fc1") and hasattr(experts.linear_fc1, "weight0"):  # TEGroupedMLP
        w0 = torch.stack([getattr(experts.linear_fc1, f"weight{i}") for i in range(el)])
        w1 = torch.stack([getattr(experts.linear_fc2, f"weight{i}") for i in range(el)])
    else:
        raise TypeError(f"comet.megatron: unsupported expert module {type(experts).__name__} "
                        "(expected SequentialMLP, GroupedMLP or TEGroupedMLP)")
    return w0.contiguous(), w1.contiguous(), False


class CometMoELayer(MoELayer):
    """Megatron's MoELayer with dispatch / expert compute / combine on Comet's fused ops.

    Extra keyword arguments: ``buffer`` (a comet.Buffer for the layer's group -- the
    expert-parallel group, or with expert tensor parallelism the tp_ep group; default: the ops'
    buffer of that group on the tokens' backend - the NVSHMEM one
    for CUDA tensors, created on first forward), ``n_comm`` / ``tile`` (launch
    overrides), ``sm_margin`` (SMs the ops leave free for the collectives Megatron overlaps with
    them on other streams; default the buffer's, see docs/gpu.md "SM margin"), ``delay_wgrad`` (defer expert weight gradients to backward_dw), ``max_rows`` (the
    ops' row bound; default: from config.moe_expert_capacity_factor, see the module docstring),
    ``cache_expert_weights`` (default True: keep stacked SequentialMLP weights between forwards
    until a parameter's version or the process's optimizer step count changes; see the module
    docstring)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *,
                 buffer=None, n_comm=None, tile=None, delay_wgrad=None, max_rows=None,
                 cache_expert_weights=True, sm_margin=None):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        build_config = config
        if config.moe_shared_expert_overlap:  # see the module docstring: the same experts
            build_config = copy.copy(config)
            build_config.moe_shared_expert_overlap = False
        with _without_token_dispatcher():
            super().__init__(config=build_config, submodules=submodules,
                             layer_number=layer_number, pg_collection=pg_collection)
        self.config = config
        self.shared_expert_overlap = config.moe_shared_expert_overlap
        self.token_dispatcher = None  # never built: Comet's ops dispatch and combine
        self.expt_tp_group = pg_collection.expt_tp
        if not torch.cuda.is_available():  # see the module docstring
            self.router.gating = types.MethodType(_gating_without_cuda, self.router)
        self._check_supported()
        self.comet_tp_size = mcore_utils.get_pg_size(self.expt_tp_group)
        self.comet_fused_activation = None  # set by dispatch: the activation fused into layer0
        self.comet_group = self._comet_group(pg_collection)
        group_size = mcore_utils.get_pg_size(self.comet_group)
        if buffer is not None and buffer.world != group_size:
            raise ValueError(f"comet.megatron.CometMoELayer: buffer has world {buffer.world} but "
                             f"the layer's group has {group_size} ranks (expert_model_parallel_"
                             "size x expert_tensor_parallel_size)")
        self.comet_buffer = buffer
        self.comet_launch = dict(n_comm=n_comm, tile=tile, sm_margin=sm_margin)
        if delay_wgrad is None:
            delay_wgrad = bool(getattr(config, "delay_wgrad_compute", False))
        self.wgrad_queue = cag.DeferredWeightGrads() if delay_wgrad else None
        self.comet_max_rows = max_rows
        self._hidden_shape = None
        self._shared = None  # shared experts: (input, ready event), then their pending output
        self.cache_expert_weights = bool(cache_expert_weights)
        self._weights = None  # (key, (w0, w1, transposed)): see _expert_weights

    def _comet_group(self, pg_collection):
        """The group comet's ops run on. Without expert tensor parallelism: Megatron's
        expert-parallel group. With expert_tensor_parallel_size t > 1: Megatron's expert
        tensor-and-model-parallel group (pg_collection.tp_ep, the EP x ETP ranks that exchange
        tokens), which comet requires TP-innermost -- group rank = ep_rank * t + tp_rank, the
        order upstream's alltoall dispatcher also assumes (it reshapes its gather over tp_ep as
        [ep, tp]). Checked on every rank (a rank outside that order would get other experts' rows),
        so a pg_collection built another way is refused, not run wrong."""
        t = self.comet_tp_size
        if t == 1:
            return self.ep_group
        group = getattr(pg_collection, "tp_ep", None)
        if group is None:
            raise ValueError("comet.megatron.CometMoELayer: expert_tensor_parallel_size "
                             f"{t} > 1 needs pg_collection.tp_ep (the expert tensor-and-model-"
                             "parallel group)")
        ep = mcore_utils.get_pg_size(self.ep_group)
        ep_rank = mcore_utils.get_pg_rank(self.ep_group)
        tp_rank = mcore_utils.get_pg_rank(self.expt_tp_group)
        size, rank = mcore_utils.get_pg_size(group), mcore_utils.get_pg_rank(group)
        if size != ep * t or rank != ep_rank * t + tp_rank:
            raise ValueError(
                "comet.megatron.CometMoELayer: the expert tensor-and-model-parallel group "
                f"(pg_collection.tp_ep, size {size}) must hold expert_model_parallel_size {ep} x "
                f"expert_tensor_parallel_size {t} ranks TP-innermost (rank = ep_rank * {t} + "
                f"tp_rank), but this rank is {rank} there with ep_rank {ep_rank}, tp_rank "
                f"{tp_rank}")
        return group

    def _check_supported(self):
        c = self.config
        problems = []
        if c.moe_latent_size:
            problems.append("moe_latent_size")
        if c.moe_pad_expert_input_to_capacity:
            problems.append("moe_pad_expert_input_to_capacity")
        if c.moe_router_padding_for_quantization:
            problems.append("moe_router_padding_for_quantization")
        if c.fp8 or getattr(c, "fp4", None):
            problems.append("fp8/fp4")
        if c.add_bias_linear:
            problems.append("add_bias_linear (expert biases)")
        if c.moe_apply_probs_on_input:
            problems.append("moe_apply_probs_on_input")
        if problems:
            raise ValueError("comet.megatron.CometMoELayer does not support: " + ", ".join(problems))

    # -- helpers -------------------------------------------------------------------------------------

    def _defer(self):
        if self.wgrad_queue is None:
            return contextlib.nullcontext()
        return cag.defer_weight_grads(self.wgrad_queue)

    def _expert_weights(self, dtype):
        """(w0, w1, transposed) in `dtype`, differentiable. Stacked (or cast) at most once per
        forward: dispatch stores them, combine reuses them (the parameters cannot change in
        between), and with cache_expert_weights later forwards too while the key holds: the
        parameters' identity, storage and version counter (bumped by any in-place write through
        the parameter), the optimizer steps taken so far (writes through .data follow a step),
        the dtype and the grad mode (a no_grad stack has no graph)."""
        params = tuple(self.experts.parameters())
        key = (dtype, torch.is_grad_enabled(), _OPTIMIZER_STEPS[0],
               tuple((id(p), p.data_ptr(), p._version) for p in params))
        if self._weights is not None and self._weights[0] == key:
            return self._weights[1]
        w0, w1, t = expert_weights(self.experts, self.num_local_experts, self.config.hidden_size)
        weights = (w0.to(dtype).contiguous(), w1.to(dtype).contiguous(), t)
        self._weights = (key, weights)
        return weights

    def _row_bound(self, tokens: int):
        """layer0's max_rows for a call of `tokens` tokens per rank (None: the dynamic path)."""
        c, world = self.config, mcore_utils.get_pg_size(self.comet_group)
        if self.comet_buffer is not None:
            world = self.comet_buffer.world
        k, e, t = c.moe_router_topk, c.num_moe_experts, self.comet_tp_size
        if self.comet_max_rows == comet_nn.WORST_CASE:
            return comet_nn.worst_case_rows(tokens, k, e, world, tp_size=t)
        if self.comet_max_rows is not None:
            return None if self.comet_max_rows < 0 else int(self.comet_max_rows)
        if c.moe_expert_capacity_factor is None:
            return None
        capacity = get_capacity(tokens * k, e, c.moe_expert_capacity_factor)
        return comet_nn.worst_case_rows(tokens, k, e, world, capacity, tp_size=t)

    def _fused_activation(self) -> str | None:
        """The activation comet.moe_layer0 fuses for this config (activation=), or None where
        _activation runs after layer0: Megatron's own F.silu / F.gelu, gated (GLU, no clamp, no
        linear offset: "swiglu" / "geglu") or not ("silu" / "gelu"); TE's activation modules
        keep theirs."""
        c = self.config
        if c.use_te_activation_func:
            return None
        base = {F.silu: "silu", F.gelu: "gelu"}.get(c.activation_func)
        if base is None or not c.gated_linear_unit:
            return base
        if c.activation_func_clamp_value is not None or c.glu_linear_offset:
            return None
        return "swiglu" if base == "silu" else "geglu"

    def _activation(self, y: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.use_te_activation_func:
            act = getattr(self.experts, "activation_func", None)
            if act is None:
                act = self.experts.local_experts[0].activation_func
            return act(y).contiguous()
        if c.gated_linear_unit:
            gate, linear = torch.chunk(y, 2, dim=-1)
            if (val := c.activation_func_clamp_value) is not None:
                gate = gate.clamp(min=None, max=val)
                linear = linear.clamp(min=-val, max=val)
            return (c.activation_func(gate) * (linear + c.glu_linear_offset)).contiguous()
        return c.activation_func(y).contiguous()

    def _shared_forward(self, hidden_states):
        """Megatron's shared experts on hidden_states, with its selective recompute if set."""
        if self.shared_experts_recompute:
            from megatron.core import tensor_parallel

            return tensor_parallel.checkpoint(self.shared_experts, False, hidden_states)
        return self.shared_experts(hidden_states)

    # -- the MoELayer steps ----------------------------------------------------------------------

    def shared_experts_compute(self, hidden_states):
        """Megatron computes the shared experts here, before routing; Comet only notes their input
        and issues them between dispatch and combine (routed_experts_compute). Returns None: the
        output is added in postprocess."""
        self._shared = None
        if self.use_shared_expert:
            self._shared = (hidden_states, sidestream.mark_ready(hidden_states))
        return None

    def preprocess(self, hidden_states, probs, routing_map):
        """Flatten the tokens and turn Megatron's routing into comet's (ids, weights)."""
        self._hidden_shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        return tokens, routing_to_topk(probs, routing_map, self.config.moe_router_topk)

    def dispatch(self, hidden_states, probs):
        """Dispatch fused with the first expert GEMM (comet.moe_layer0)."""
        topk_ids, topk_weights = probs
        if not self.cache_expert_weights:
            self._weights = None  # a fresh stack for this forward
        w0, _, transposed = self._expert_weights(hidden_states.dtype)
        self.comet_fused_activation = self._fused_activation()
        with self._defer():
            y0, layout = comet.moe_layer0(hidden_states.contiguous(), w0, topk_ids,
                                          num_experts=self.config.num_moe_experts,
                                          w0_transposed=transposed,
                                          max_rows=self._row_bound(hidden_states.shape[0]),
                                          group=self.comet_group, buffer=self.comet_buffer,
                                          tp_size=self.comet_tp_size,
                                          activation=self.comet_fused_activation,
                                          **self.comet_launch)
        return y0, (layout, topk_weights)

    def routed_experts_compute(self, hidden_states, probs):
        """The activation on the dispatched rows; fc2 runs fused with the combine."""
        layout, topk_weights = probs
        if self._shared is not None:  # layer0 is issued: the shared experts go beside it
            shared_input, ready = self._shared
            self._shared = sidestream.run_beside(self._shared_forward, shared_input, ready)
        h = hidden_states if self.comet_fused_activation else self._activation(hidden_states)
        return (h, layout, topk_weights), None

    def combine(self, output):
        """Second expert GEMM fused with the weighted top-k reduce and the combine
        (comet.moe_layer1); the result is already on each token's home rank."""
        h, layout, topk_weights = output
        _, w1, transposed = self._expert_weights(h.dtype)
        if not self.cache_expert_weights:
            self._weights = None  # this forward's stack: not kept past it
        if topk_weights.dtype not in (torch.float32, h.dtype):
            topk_weights = topk_weights.float()
        with self._defer():
            return comet.moe_layer1(h, w1, topk_weights, layout, w1_transposed=transposed,
                                    group=self.comet_group,
                                    buffer=self.comet_buffer, **self.comet_launch)

    def postprocess(self, output, shared_expert_output):
        output = output.view(self._hidden_shape)
        if self._shared is not None:
            if isinstance(self._shared, tuple):
                raise RuntimeError("comet.megatron: the shared experts were not issued (the "
                                   "layer's steps ran out of order)")
            shared_expert_output, self._shared = sidestream.join(self._shared), None
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output

    def backward_dw(self, routed_experts: bool = True, shared_experts: bool = False):
        """Apply the deferred expert weight gradients (delay_wgrad) and, if asked, the shared
        experts' (Megatron's own backward_dw)."""
        if routed_experts and self.wgrad_queue is not None:
            self.wgrad_queue.compute()
        if shared_experts and self.use_shared_expert and not self.shared_expert_overlap:
            self.shared_experts.backward_dw()


def comet_moe_spec(spec):
    """A deep copy of a Megatron module spec (a layer ModuleSpec, a block spec with layer_specs, or
    any nesting of them) with every MoELayer replaced by CometMoELayer. Use it for the
    transformer_layer_spec of GPTModel to run all its MoE layers on Comet."""
    spec = copy.deepcopy(spec)
    _swap(spec, set())
    return spec


def _swap(obj, seen):
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, ModuleSpec):
        if isinstance(obj.module, type) and issubclass(obj.module, MoELayer) and \
                not issubclass(obj.module, CometMoELayer):
            if obj.module is not MoELayer:
                raise TypeError(f"comet_moe_spec: {obj.module.__name__} is a customised MoELayer; "
                                "subclass CometMoELayer instead")
            obj.module = CometMoELayer
        _swap(obj.submodules, seen)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _swap(item, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _swap(getattr(obj, f.name), seen)
