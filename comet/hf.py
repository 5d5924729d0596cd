"""Comet as a Hugging Face transformers "experts implementation" (transformers 5.x).

transformers 5 routes the forward of every MoE experts module decorated with
``@use_experts_implementation`` (Mixtral, Qwen2-MoE, OLMoE, GPT-OSS, Qwen3-MoE, DeepSeek-V2/3, ...)
through ``ExpertsInterface`` by the name in ``config._experts_implementation``. ``register()`` adds
"comet" there; the experts then run ``comet.moe_layer0`` (dispatch + first GEMM) -> the model's own
activation -> ``comet.moe_layer1`` (second GEMM + weighted top-k reduce + combine), the activation
fused into layer0's epilogue where it is one comet fuses (``fused_activation``: SwiGLU / GeGLU
through transformers' default gate, SiLU / GELU without one):

    import comet.hf
    comet.hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="comet")
    # or: model = MixtralForCausalLM(MixtralConfig(..., experts_implementation="comet"))
    # or, on a built model: model.set_experts_implementation("comet")

Weights are the module's own parameters, passed to the ops as they are (checkpoints, optimisers and
``state_dict`` are unchanged; no copy, and the gradients land on the parameters):

* w0: ``gate_up_proj`` (``up_proj`` for experts without a gate), [E, N0, H]; models that store it
  transposed (``is_transposed``, e.g. GPT-OSS: [E, H, N0]) pass ``w0_transposed=True`` (read
  in place through strides by the CPU backend and by both CUDA paths).
  The N0 columns keep the model's order, concatenated [gate; up] or interleaved [g0, u0, g1, ...]
  (GPT-OSS), because the activation applied to layer0's rows is the module's own ``_apply_gate``
  (``act_fn`` without a gate): GPT-OSS's clamped, alpha-scaled SwiGLU with the +1 on up included.
* w1: ``down_proj`` [E, H, N1] ([E, N1, H] with ``w1_transposed`` for ``is_transposed`` models).
* Biases (``has_bias``, e.g. GPT-OSS): the ops' b0 = ``gate_up_proj_bias`` / ``up_proj_bias``
  and b1 = ``down_proj_bias``, added in the GEMMs' epilogue; b1 is part of each slot's result, so
  ``out = sum_j w_j (h_j W1^T + b1[e_j])`` as in the eager module.

Expert parallelism: ``shard_experts(model, group)`` keeps on each rank r of a W-rank
torch.distributed group experts [r*E/W, (r+1)*E/W) (every experts parameter is sliced) and makes
the experts run comet with that group: each rank feeds its own tokens, comet sends every token to
the ranks of its experts and the results back. See its docstring for the gradient semantics.

Sync-free path: transformers' routers drop nothing, so no bound is implied; ``set_max_rows(model,
rows)`` gives every experts module one (an int bound on the rows any rank receives per call, or
comet.nn.WORST_CASE: W * T * min(k, E/W) for the call's T tokens per rank, a true bound when every
rank feeds the same T), and the ops then run with static shapes and no host synchronisation on
CUDA. A call receiving more rows than an int bound raises on every rank.

Not supported (a clear error at the first forward): experts with a post-expert norm
(``has_post_expert_norm``: it sits between the second GEMM and the weighted reduce that comet
fuses), transformers' own expert parallelism (``_is_expert_parallel``: use ``shard_experts``),
and, in a process where torch.distributed is initialised, unsharded experts on CUDA (comet would
need a single-rank group there; shard the experts instead).
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch import nn

import comet
from comet import nn as comet_nn
from comet.buffers import symm

__all__ = ["NAME", "register", "experts_forward", "comet_weights", "fused_activation",
           "shard_experts", "is_experts_module", "set_max_rows"]

NAME = "comet"

# Parameters of an experts module that have one slice per expert along dim 0.
_EXPERT_PARAMS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias",
                  "down_proj_bias")


def register(name: str = NAME) -> str:
    """Register comet's experts forward in transformers' ExpertsInterface under `name` (idempotent).
    Afterwards ``experts_implementation=name`` is accepted by configs, ``from_pretrained`` and
    ``model.set_experts_implementation``. Returns the name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, experts_forward)
    return name


def is_experts_module(module: nn.Module) -> bool:
    """True for modules built by transformers' ``@use_experts_implementation`` (they carry the
    layout flags it sets) that have 3-D expert weights."""
    return (hasattr(module, "is_transposed") and hasattr(module, "has_gate")
            and isinstance(getattr(module, "down_proj", None), torch.Tensor)
            and module.down_proj.dim() == 3)


def _num_experts(module) -> int:
    """The global expert count (shard_experts keeps it when the weights become local slices)."""
    return int(getattr(module, "comet_num_experts", module.num_experts))


def comet_weights(module: nn.Module):
    """The ops' weight arguments of a transformers experts module: a dict with w0, w1, b0, b1 (the
    module's parameters themselves, None for absent biases) and w0_transposed / w1_transposed."""
    if module.has_gate:
        w0, b0 = module.gate_up_proj, getattr(module, "gate_up_proj_bias", None)
    else:
        w0, b0 = module.up_proj, getattr(module, "up_proj_bias", None)
    w1, b1 = module.down_proj, getattr(module, "down_proj_bias", None)
    if module.has_bias:
        if b0 is None or b1 is None:
            raise ValueError(f"comet.hf: {type(module).__name__} has has_bias=True but no "
                             "gate_up_proj_bias/up_proj_bias and down_proj_bias parameters")
    else:
        b0 = b1 = None
    t = bool(module.is_transposed)  # stored [E, in, out]: the ops read it as it is
    return dict(w0=w0.contiguous(), w1=w1.contiguous(), b0=b0, b1=b1, w0_transposed=t,
                w1_transposed=t)


def _act_base(act) -> str | None:
    """"silu" / "gelu" when act is that exact function (GELU's erf form, not a tanh one)."""
    from transformers import activations as hf_act

    if isinstance(act, (nn.SiLU, getattr(hf_act, "SiLUActivation", nn.SiLU))):
        return "silu"
    if isinstance(act, nn.GELU) and act.approximate == "none":
        return "gelu"
    if type(act) is getattr(hf_act, "GELUActivation", None):  # exact erf either way
        return "gelu"
    return None


def fused_activation(module: nn.Module) -> str | None:
    """The activation comet.moe_layer0 fuses for a transformers experts module (activation=), or
    None where the module's own runs after layer0: a gate applied by transformers' default
    ``_apply_gate`` (act(gate) * up on [gate; up]) with SiLU (Mixtral, Qwen-MoE, DeepSeek:
    "swiglu") or exact GELU ("geglu"), or plain experts with SiLU / GELU. A model's own gate
    (GPT-OSS's clamped, interleaved SwiGLU) keeps its activation."""
    base = _act_base(getattr(module, "act_fn", None))
    if base is None:
        return None
    if not module.has_gate:
        return base
    from transformers.integrations import moe as hf_moe

    default = getattr(hf_moe, "_default_apply_gate", None)
    if default is None or getattr(type(module), "_apply_gate", None) is not default:
        return None
    return "swiglu" if base == "silu" else "geglu"


_local = {}
_local_lock = threading.Lock()


def _call_args(module, x: torch.Tensor) -> dict:
    """group/buffer for the ops: the sharded module's group, else a world of one."""
    if getattr(module, "comet_sharded", False):
        return dict(group=module.comet_group, buffer=module.comet_buffer)
    if not (dist.is_available() and dist.is_initialized()):
        return dict(group=None, buffer=None)  # the ops' default is a world of one here
    # torch.distributed is up (e.g. data parallelism), but these experts are whole on every rank:
    # the default group would make them expert-parallel over it. Use a private world of one.
    if x.device.type != "cpu":
        raise NotImplementedError(
            f"comet.hf: unsharded experts on {x.device} in a process where torch.distributed is "
            "initialised; call comet.hf.shard_experts(model, group) to run them expert-parallel")
    return dict(group=None, buffer=_local[_local_buffer_key()])  # a dict read: compiles


# Runs while tracing under torch.compile instead of being traced (the lock cannot be).
@torch.compiler.assume_constant_result
def _local_buffer_key() -> str:
    with _local_lock:
        if "cpu" not in _local:
            _local["cpu"] = symm.Buffer.simulated_world(1)[0]
    return "cpu"


def set_max_rows(model: nn.Module, max_rows) -> nn.Module:
    """Give every transformers experts module of `model` the ops' row bound: an int >= 0,
    comet.nn.WORST_CASE, or None / -1 for the dynamic path (the default). Returns the model."""
    if not (max_rows is None or max_rows == comet_nn.WORST_CASE or
            (isinstance(max_rows, int) and not isinstance(max_rows, bool) and max_rows >= -1)):
        raise ValueError(f"comet.hf.set_max_rows: max_rows={max_rows!r} must be an int >= -1, "
                         f"{comet_nn.WORST_CASE!r} or None")
    modules = [m for m in model.modules() if is_experts_module(m)]
    if not modules:
        raise ValueError(f"comet.hf.set_max_rows: {type(model).__name__} has no transformers "
                         "experts module (@use_experts_implementation)")
    for m in modules:
        m.comet_max_rows = None if max_rows == -1 else max_rows
    return model


def _row_bound(module, tokens: int, topk: int, num_experts: int, kw: dict):
    """layer0's max_rows for this call (None: the dynamic path)."""
    bound = getattr(module, "comet_max_rows", None)
    if bound != comet_nn.WORST_CASE:
        return bound
    if kw["buffer"] is not None:
        world = kw["buffer"].world
    elif kw["group"] is not None or (dist.is_available() and dist.is_initialized()):
        world = dist.get_world_size(kw["group"])
    else:
        world = 1
    return comet_nn.worst_case_rows(tokens, topk, num_experts, world)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The forward comet registers for transformers' experts modules (``self`` is the module):
    hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k] -> [T, H] in hidden_states'
    dtype, equal to the module's eager forward."""
    name = type(self).__name__
    if getattr(self, "has_post_expert_norm", False):
        raise NotImplementedError(
            f"comet.hf: {name} applies a norm after each expert, between the second GEMM and the "
            "weighted reduce that comet fuses; use another experts_implementation for it")
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError(
            f"comet.hf: {name} is sharded by transformers' own expert parallelism; load the model "
            "unsharded and use comet.hf.shard_experts(model, group) instead")
    if hidden_states.dim() != 2 or top_k_index.shape != top_k_weights.shape or \
            top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"comet.hf: expected hidden_states [T, H] and top_k_index / top_k_weights "
                         f"[T, k], got {tuple(hidden_states.shape)}, {tuple(top_k_index.shape)}, "
                         f"{tuple(top_k_weights.shape)}")
    w = comet_weights(self)
    num_experts = _num_experts(self)
    x = hidden_states.to(w["w0"].dtype).contiguous()
    b0, b1 = (None if b is None else b.to(x.dtype) for b in (w["b0"], w["b1"]))
    weights = top_k_weights
    if weights.dtype not in (torch.float32, x.dtype):
        weights = weights.float()  # comet takes fp32 or the activations' dtype
    kw = _call_args(self, x)
    bound = _row_bound(self, x.shape[0], top_k_index.shape[1], num_experts, kw)
    fused = fused_activation(self)
    y0, layout = comet.moe_layer0(x, w["w0"], top_k_index, num_experts=num_experts, b0=b0,
                                  w0_transposed=w["w0_transposed"], max_rows=bound,
                                  activation=fused, **kw)
    # Fused into layer0, else the module's own activation on the dispatched rows (same column
    # order as its weights).
    h = y0 if fused else self._apply_gate(y0) if self.has_gate else self.act_fn(y0)
    out = comet.moe_layer1(h.contiguous(), w["w1"], weights.contiguous(), layout, b1=b1,
                           w1_transposed=w["w1_transposed"], **kw)
    return out.to(hidden_states.dtype)


def shard_experts(model: nn.Module, group=None, *, buffer: symm.Buffer | None = None,
                  set_implementation: bool = True) -> nn.Module:
    """Shard every transformers experts module of `model` over an expert-parallel group, in place.

    Rank r of the W ranks of `group` (None: the default torch.distributed group; or `buffer`, a
    comet.Buffer, which defines the group) keeps experts [r*E/W, (r+1)*E/W) of each experts
    module: every per-expert parameter (gate_up_proj / up_proj, down_proj and their biases) is
    replaced by a new Parameter holding that slice. The module then runs comet's ops over the
    group: each rank passes its own tokens through the whole model, and comet dispatches each
    (token, expert) pair to the expert's rank and combines the results on the token's rank.
    Everything else (attention, routers, embeddings) stays replicated. Call it on every rank, on
    identical unsharded models (e.g. after from_pretrained), before building the optimiser.

    Gradients: an expert parameter's gradient on its rank already sums every rank's tokens (the
    backward sends them there), while replicated parameters see only the local tokens; the
    parameters carry ``comet_expert_parallel = True`` (and ``allreduce = False``) so
    ``comet.nn.allreduce_gradients(model, group)`` averages the replicated gradients over the
    group and divides the expert gradients by W (the gradients of the mean loss over the ranks).

    `set_implementation` also switches the model to comet (``set_experts_implementation``; the
    name must be registered, see register()); the sharded modules cannot run eagerly any more.
    Raises ValueError naming the module when its expert count is not divisible by W.
    Returns the model.
    """
    if buffer is not None:
        rank, world = buffer.rank, buffer.world
    elif group is not None or (dist.is_available() and dist.is_initialized()):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    else:
        raise ValueError("comet.hf.shard_experts: torch.distributed is not initialised and no "
                         "group or buffer was given")
    experts = [(n, m) for n, m in model.named_modules() if is_experts_module(m)]
    if not experts:
        raise ValueError(f"comet.hf.shard_experts: {type(model).__name__} has no transformers "
                         "experts module (@use_experts_implementation)")
    for name, m in experts:
        if getattr(m, "comet_sharded", False):
            raise ValueError(f"comet.hf.shard_experts: {name} is already sharded")
        e = int(m.num_experts)
        if e % world:
            raise ValueError(f"comet.hf.shard_experts: {name} has num_experts={e}, not divisible "
                             f"by the group size {world}")
    for _, m in experts:
        e = int(m.num_experts)
        per = e // world
        sl = slice(rank * per, (rank + 1) * per)
        for pname in _EXPERT_PARAMS:
            p = getattr(m, pname, None)
            if not isinstance(p, torch.Tensor):
                continue
            local = nn.Parameter(p.detach()[sl].clone(), requires_grad=p.requires_grad)
            local.comet_expert_parallel = True
            local.allreduce = False
            setattr(m, pname, local)
        # num_experts stays global (the routers' ids are global); an eager forward over the
        # local slices would then fail on indexing instead of silently skipping experts.
        m.comet_num_experts = e
        m.comet_expert_offset = rank * per
        m.comet_group, m.comet_buffer, m.comet_sharded = group, buffer, True
    if set_implementation and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(NAME)
    return model
