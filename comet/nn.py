"""comet.nn.MoE: a plain-PyTorch expert-parallel MoE feed-forward layer on comet's fused ops.

    moe = comet.nn.MoE(hidden_size=1024, ffn_hidden_size=2816, num_experts=8, topk=2)
    out = moe(x)                 # x [..., H] -> out [..., H]; moe.aux_loss holds the last aux loss
    loss = criterion(out, y)     # the load-balancing loss gradient is already attached to `out`
    loss.backward()
    comet.nn.allreduce_gradients(moe)   # replicated (router) grads: average over the group

* Router: fp32 linear gate -> softmax -> top-k (optionally renormalised so a token's k weights sum
  to 1). The router weight is replicated on every rank of the expert-parallel group.
* Load balancing (Switch Transformer / Megatron "aux_loss"):
  aux = coeff * E * sum_e f_e * P_e, f_e = share of this rank's routed slots that chose e,
  P_e = mean router probability of e over this rank's tokens. Its gradient is attached to the
  output (like Megatron's MoEAuxLossAutoScaler), so `loss.backward()` includes it; the value is in
  `moe.aux_loss` (detached) for logging. Scale it with `MoE.aux_loss_scale` when the main loss is
  scaled (gradient accumulation, loss scaling).
* Experts: gated SwiGLU, `silu(x W_gate^T) * (x W_up^T) W_down^T`. Rank r of a W-rank group holds
  experts [r*E/W, (r+1)*E/W): w0 [E/W, 2F, H] (gate rows first, then up rows) and w1 [E/W, H, F].
  layer0 = dispatch + W0 GEMM with the SwiGLU fused into its epilogue (`activation="swiglu"`;
  `moe.fused_activation` says which ran fused, None with fp8=True, whose wrappers take none and
  get it applied to layer0's output), layer1 = W1 GEMM + weighted top-k reduce + combine
  (comet.moe_layer0/1); both ops are differentiable (comet.layers.autograd).
* Shared expert (optional, `shared_ffn_hidden_size=S`; DeepSeek-MoE / Qwen2-MoE style): a SwiGLU
  MLP every token passes through, `silu(x Ws_gate^T) * (x Ws_up^T) Ws_down^T` with shared_w0 [2S, H]
  (gate rows first) and shared_w1 [H, S], replicated on every rank, optionally scaled per token by
  `sigmoid(x shared_gate^T)` (`shared_expert_gate=True`, shared_gate [1, H], as Qwen2-MoE's
  shared_expert_gate). It is computed after moe_layer0 is issued and before moe_layer1, and added
  to the routed output: on CUDA on a side stream (comet.layers.sidestream), overlapping the routed
  path's dispatch and GEMMs; on the CPU in between the two ops. The result equals computing it
  separately and adding it.
* Expert parameters carry `param.comet_expert_parallel = True` (and `allreduce = False`, the flag
  Megatron's optimizer uses): each rank owns them and their gradients already contain every rank's
  tokens, so data-parallel gradient averaging must skip them over the expert-parallel group.
* Initialisation is deterministic from `seed` and independent of the group size: the router is
  identical on every rank, and global expert e is the same tensor whichever rank holds it.
* Sync-free path: with a bound on the rows a rank can receive the ops take `max_rows` (static
  shapes, no host synchronisation on CUDA, CUDA-graph capturable). `capacity_factor=c` drops the
  slots beyond each expert's capacity C = ceil(T k / E * c) on every source rank (first come, first
  served in token then slot order; the aux loss sees the routing before dropping, as Megatron's),
  which bounds the rows: max_rows = worst_case_rows(T, k, E, W, C). `max_rows=R` gives a bound
  directly ("worst_case": the bound without dropping, W * T * min(k, E/W)); `max_rows=-1` keeps
  the dynamic path. Every rank must then feed the same number of tokens T per call (the bound is
  computed from the local T); a rank receiving more than the bound raises on every rank.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import comet
from comet.layers import sidestream
from comet.buffers import symm

__all__ = ["MoE", "WORST_CASE", "allreduce_gradients", "drop_over_capacity", "expert_capacity",
           "load_balancing_loss", "swiglu", "worst_case_rows"]

WORST_CASE = "worst_case"


def expert_capacity(tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Slots each expert takes from one source rank: ceil(T k / E * capacity_factor) (Megatron's
    get_capacity of its token dropping)."""
    return math.ceil((tokens * topk / num_experts) * capacity_factor)


def worst_case_rows(tokens: int, topk: int, num_experts: int, world: int,
                    capacity: int | None = None, tp_size: int = 1) -> int:
    """A true bound on the rows M any rank receives when each of the `world` ranks sends `tokens`
    tokens, each to `topk` distinct experts, and (with `capacity`) at most `capacity` slots to one
    expert: a source sends one rank at most T * min(k, E_local) rows, and at most
    E_local * min(C, T) with a capacity (a token reaches an expert once). With tp_size t,
    E_local = E / (W / t) (every tp rank of an EP rank receives its EP rank's rows)."""
    local = num_experts // (world // tp_size)
    per_source = tokens * min(topk, local)
    if capacity is not None:
        per_source = min(per_source, local * min(int(capacity), tokens))
    return world * per_source


def drop_over_capacity(topk_ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """topk_ids [T, k] with every slot past its expert's first `capacity` (in token, then slot
    order) set to -1 (dropped). Slots already -1 stay dropped and take no capacity."""
    flat = topk_ids.reshape(-1)
    routed = flat >= 0
    key = torch.where(routed, flat, torch.full_like(flat, num_experts))  # dropped: a last group
    order = torch.sort(key, stable=True).indices  # by expert, token-then-slot order kept
    counts = torch.bincount(key, minlength=num_experts + 1)
    starts = counts.cumsum(0) - counts
    position = torch.empty_like(flat)  # each slot's place among its expert's slots
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[key[order]]
    keep = routed & (position < capacity)
    return torch.where(keep, flat, torch.full_like(flat, -1)).reshape(topk_ids.shape)



def swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(y[:, :N/2]) * y[:, N/2:] in fp32 (fp64 for float64), returned in y's dtype."""
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    gate, up = y.to(acc).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(y.dtype)


def load_balancing_loss(probs: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss E * sum_e f_e * P_e (without the coefficient).

    probs [T, E] router probabilities (differentiable), topk_ids [T, k] (-1 = dropped, ignored).
    f_e = fraction of routed slots sent to e, P_e = mean probability of e. 1.0 when perfectly
    balanced; 0 for T = 0."""
    T, k = topk_ids.shape
    if T == 0:
        return probs.sum() * 0.0
    ids = topk_ids[topk_ids >= 0]
    counts = torch.bincount(ids, minlength=num_experts).to(probs.dtype)
    f = counts / max(T * k, 1)
    return num_experts * torch.sum(f * probs.mean(0))


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `out`; backward also sends `scale` into the aux loss (Megatron's
    MoEAuxLossAutoScaler), so a loss built from `out` trains the router to balance."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        ctx.aux_meta = (aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.aux_meta
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=dtype, device=device), None


class MoE(nn.Module):
    """Expert-parallel top-k MoE with SwiGLU experts (see the module docstring).

    Args:
        hidden_size: H. ffn_hidden_size: F (per expert; w0 has 2F rows for gate and up).
        num_experts: E (divisible by the group size). topk: k.
        group: the expert-parallel process group (None: the default group if torch.distributed is
            initialised, else a world of one). buffer: a comet.Buffer to use instead (e.g. from
            Buffer.simulated_world); it defines the group.
        renormalize: divide each token's top-k weights by their sum.
        aux_loss_coeff: coefficient of the load-balancing loss (0 disables it).
        dtype: dtype of the expert weights and activations (router stays fp32).
        shared_ffn_hidden_size: S, hidden size of an optional shared expert (None: none).
        shared_expert_gate: scale the shared expert's output by a learned sigmoid gate per token.
        n_comm, tile: launch overrides passed to the ops (default: the tuner's choice).
        sm_margin: SMs the ops leave free for other kernels peers wait on (None: the buffer's;
            docs/gpu.md, "SM margin").
        capacity_factor: drop slots beyond each expert's capacity (see the module docstring) and
            take the sync-free path with the bound that implies (None: no dropping).
        max_rows: the ops' row bound: an int, WORST_CASE, -1 (dynamic even with a capacity), or
            None (from capacity_factor when set, else dynamic).
        seed, init_std: deterministic initialisation (normal(0, init_std); w1 scaled by
            1/sqrt(2 * num_layers) as in GPT-2 when num_layers is given).
        tp_size: expert tensor parallelism t (None: the buffer's, else 1). The group is
            TP-innermost (rank r: EP rank r // t, tp rank r % t; E divisible by W / t, F by t);
            the module holds shard r % t of its EP rank's experts: w0 [E_local, 2F / t, H] with
            the shard's gate rows then its up rows (so SwiGLU applies per shard), w1
            [E_local, H, F / t]. Initialisation and load_global_experts give every shard the
            same full experts as tp_size=1 (the same seed gives the same model).
        fp8: run the expert GEMMs in FP8 (comet.fp8): w0 / w1 stay the (master) parameters in
            `dtype` and are quantised per forward (128 x 128 blocks), tokens are quantised on
            dispatch and the SwiGLU output per row (1 x 128); backward in `dtype` on the
            dequantised values, so the parameters get their gradients in their own dtype.
        placement: a comet.plan.Placement (None: the buffer's, else the contiguous map; one
            built without world= completes to the group, Placement.for_world). The module
            then holds this rank's E_r slots (w0 [E_r, 2F, H], w1 [E_r, H, F], its logical
            experts ascending; E_r may be 0), every replica initialised alike (the
            initialisation is per logical expert), and allreduce_gradients sums a replicated
            expert's weight gradients over its replicas so they stay identical after the
            optimiser step (docs/placement.md). Not with tp_size > 1 or fp8.
    """

    aux_loss_scale: float = 1.0

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, topk: int, *,
                 group=None, buffer: symm.Buffer | None = None, renormalize: bool = False,
                 aux_loss_coeff: float = 1e-2, dtype: torch.dtype | None = None,
                 device=None, n_comm: int | None = None, tile: tuple[int, int] | None = None,
                 seed: int = 0, init_std: float = 0.02, num_layers: int | None = None,
                 shared_ffn_hidden_size: int | None = None, shared_expert_gate: bool = False,
                 capacity_factor: float | None = None, max_rows: int | str | None = None,
                 tp_size: int | None = None, fp8: bool = False, placement=None,
                 sm_margin: int | None = None):
        super().__init__()
        self.fp8 = bool(fp8)
        self.fused_activation = None  # set by forward: the activation fused into layer0
        if buffer is not None:
            rank, world = buffer.rank, buffer.world
        elif group is not None or (dist.is_available() and dist.is_initialized()):
            rank, world = dist.get_rank(group), dist.get_world_size(group)
        else:
            rank, world = 0, 1
        if tp_size is None:
            tp_size = getattr(buffer, "tp_size", 1) if buffer is not None else 1
        tp = symm.tp_size_setting(tp_size, world)
        ep = world // tp
        if placement is None and buffer is not None:
            placement = getattr(buffer, "placement", None)
        if placement is not None:
            placement = self._check_placement(placement, num_experts, world, tp)
            if self.fp8:
                raise ValueError("comet.nn.MoE: fp8=True with a placement is not supported "
                                 "(the FP8 layers run on the contiguous map)")
        if placement is None and num_experts % ep:
            group_size = f"expert-parallel group size {world}" if tp == 1 else \
                f"EP = group size {world} / tp_size {tp} = {ep}"
            raise ValueError(f"comet.nn.MoE: num_experts={num_experts} is not divisible by the "
                             f"{group_size}")
        if ffn_hidden_size % tp:
            raise ValueError(f"comet.nn.MoE: ffn_hidden_size={ffn_hidden_size} is not divisible "
                             f"by tp_size={tp}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"comet.nn.MoE: topk={topk} must be in [1, num_experts={num_experts}]")
        if shared_ffn_hidden_size is not None and (isinstance(shared_ffn_hidden_size, bool) or
                                                   int(shared_ffn_hidden_size) < 1):
            raise ValueError(f"comet.nn.MoE: shared_ffn_hidden_size={shared_ffn_hidden_size!r} "
                             "must be a positive int or None")
        if shared_expert_gate and shared_ffn_hidden_size is None:
            raise ValueError("comet.nn.MoE: shared_expert_gate=True needs shared_ffn_hidden_size")
        if capacity_factor is not None and not float(capacity_factor) > 0:
            raise ValueError(f"comet.nn.MoE: capacity_factor={capacity_factor!r} must be > 0")
        if not (max_rows is None or max_rows == WORST_CASE or
                (isinstance(max_rows, int) and not isinstance(max_rows, bool) and max_rows >= -1)):
            raise ValueError(f"comet.nn.MoE: max_rows={max_rows!r} must be an int >= -1, "
                             f"{WORST_CASE!r} or None")
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.max_rows = max_rows
        self.hidden_size, self.ffn_hidden_size = int(hidden_size), int(ffn_hidden_size)
        self.num_experts, self.topk = int(num_experts), int(topk)
        self.renormalize, self.aux_loss_coeff = bool(renormalize), float(aux_loss_coeff)
        self.group, self.buffer, self.n_comm, self.tile = group, buffer, n_comm, tile
        self.sm_margin = sm_margin
        self.rank, self.world, self.tp_size = rank, world, tp
        self.placement = placement
        if placement is None:
            self.num_local_experts = num_experts // ep
            self.expert_offset = (rank // tp) * self.num_local_experts
            self.local_experts = tuple(range(self.expert_offset,
                                             self.expert_offset + self.num_local_experts))
        else:  # this rank's slots, ascending logical id (expert_offset: the first, if any)
            self.local_experts = tuple(placement.local_experts(rank))
            self.num_local_experts = len(self.local_experts)
            self.expert_offset = self.local_experts[0] if self.local_experts else 0
        self.seed, self.init_std = int(seed), float(init_std)
        self.out_std = init_std / math.sqrt(2 * num_layers) if num_layers else init_std
        factory = dict(device=device, dtype=dtype or torch.get_default_dtype())
        self.router = nn.Linear(hidden_size, num_experts, bias=False, device=device,
                                dtype=torch.float32)
        self.w0 = nn.Parameter(torch.empty(self.num_local_experts, 2 * ffn_hidden_size // tp,
                                           hidden_size, **factory))
        self.w1 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size,
                                           ffn_hidden_size // tp, **factory))
        for p in (self.w0, self.w1):
            p.comet_expert_parallel = True
            p.allreduce = False
        # The shared expert is replicated like the router (its gradients are averaged over ranks).
        self.shared_ffn_hidden_size = None if shared_ffn_hidden_size is None \
            else int(shared_ffn_hidden_size)
        self.shared_w0 = self.shared_w1 = self.shared_gate = None
        if self.shared_ffn_hidden_size is not None:
            s = self.shared_ffn_hidden_size
            self.shared_w0 = nn.Parameter(torch.empty(2 * s, hidden_size, **factory))
            self.shared_w1 = nn.Parameter(torch.empty(hidden_size, s, **factory))
            if shared_expert_gate:
                self.shared_gate = nn.Parameter(torch.empty(1, hidden_size, **factory))
        self.aux_loss: torch.Tensor | None = None
        self.reset_parameters()

    # -- parameters --------------------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        self.router.weight.copy_(torch.randn(self.router.weight.shape, generator=g) * self.init_std)
        for le, e in enumerate(self.local_experts):
            ge = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * e + 1)
            w0 = torch.randn(2 * self.ffn_hidden_size, self.hidden_size, generator=ge)
            w1 = torch.randn(self.hidden_size, self.ffn_hidden_size, generator=ge)
            self.w0[le].copy_(self._w0_shard(w0 * self.init_std))
            self.w1[le].copy_(self._w1_shard(w1 * self.out_std))
        if self.shared_w0 is not None:  # own generator: the routed weights do not depend on it
            gs = torch.Generator().manual_seed(self.seed * 1_000_003 + 104_729)
            self.shared_w0.copy_(torch.randn(self.shared_w0.shape, generator=gs) * self.init_std)
            self.shared_w1.copy_(torch.randn(self.shared_w1.shape, generator=gs) * self.out_std)
            if self.shared_gate is not None:
                self.shared_gate.copy_(torch.randn(self.shared_gate.shape, generator=gs) *
                                       self.init_std)

    def _w0_shard(self, w0: torch.Tensor) -> torch.Tensor:
        """This rank's tp shard of full w0 rows [..., 2F, H]: its gate rows, then its up rows."""
        if self.tp_size == 1:
            return w0
        f, r = self.ffn_hidden_size // self.tp_size, self.rank % self.tp_size
        gate, up = w0.chunk(2, dim=-2)
        return torch.cat([gate[..., r * f:(r + 1) * f, :], up[..., r * f:(r + 1) * f, :]], dim=-2)

    def _w1_shard(self, w1: torch.Tensor) -> torch.Tensor:
        """This rank's tp shard of full w1 [..., H, F]: its F / t columns."""
        f, r = self.ffn_hidden_size // self.tp_size, self.rank % self.tp_size
        return w1[..., r * f:(r + 1) * f]

    @torch.no_grad()
    def load_global_experts(self, w0: torch.Tensor, w1: torch.Tensor) -> None:
        """Copy this rank's slice of global expert weights w0 [E, 2F, H], w1 [E, H, F] (its EP
        rank's experts; with tp_size > 1 its shard of them)."""
        sl = list(self.local_experts)
        self.w0.copy_(self._w0_shard(w0[sl]))
        self.w1.copy_(self._w1_shard(w1[sl]))

    @staticmethod
    def _check_placement(placement, num_experts: int, world: int, tp: int):
        """The placement on this module's group (Placement.for_world: one built without world=
        completes to it), after checking it fits the module."""
        from comet.plan import Placement

        if not isinstance(placement, Placement):
            raise TypeError(f"comet.nn.MoE: placement must be a comet.plan.Placement, got "
                            f"{type(placement).__name__}")
        if placement.num_experts != num_experts:
            raise ValueError(f"comet.nn.MoE: the placement places {placement.num_experts} experts "
                             f"but the module has num_experts={num_experts}")
        try:
            placed = placement.for_world(world)
        except ValueError as e:
            raise ValueError(f"comet.nn.MoE: {e}") from None
        if tp != 1:
            raise ValueError(f"comet.nn.MoE: tp_size={tp} > 1 is not supported with a placement")
        return placed

    @torch.no_grad()
    def migrate(self, placement, optimizer=None, group=None) -> None:
        """Move this module's experts to `placement` (every rank of the group calls it), with one
        all_to_all_single (comet.plan.migrate) for w0, w1 and, when `optimizer` is given, the
        optimiser's per-parameter state tensors of w0 / w1 (e.g. Adam's exp_avg, exp_avg_sq), so
        nothing of the optimiser's state is lost: a slot's state follows its expert. The
        parameters stay the same Parameter objects (optimiser param groups keep working); their
        .data is replaced (shape [E_r', ...]) and their .grad dropped (call between steps). Without
        `optimizer`, per-slot optimiser state is left as it was and no longer matches its expert:
        reset it."""
        from comet.plan import Placement, migrate

        old = self.placement or Placement.contiguous(self.num_experts, self.world)
        placement = self._check_placement(placement, self.num_experts, self.world, self.tp_size)
        ws = [self.w0, self.w1]
        states = []  # (param, key) of each state tensor shaped like its parameter
        if optimizer is not None:
            for w in ws:
                for key, v in sorted(optimizer.state.get(w, {}).items()):
                    if isinstance(v, torch.Tensor) and v.shape == w.shape:
                        states.append((w, key))
        moved = migrate(old, placement, *[w.data for w in ws],
                        *[optimizer.state[w][key] for w, key in states], group=group)
        for w, t in zip(ws, moved[:2]):
            w.data = t
            w.grad = None
        for (w, key), t in zip(states, moved[2:]):
            optimizer.state[w][key] = t
        self.placement = placement
        self.local_experts = tuple(placement.local_experts(self.rank))
        self.num_local_experts = len(self.local_experts)
        self.expert_offset = self.local_experts[0] if self.local_experts else 0

    def expert_parameters(self):
        return [self.w0, self.w1]

    def replicated_parameters(self):
        return [p for p in self.parameters() if not getattr(p, "comet_expert_parallel", False)]

    # -- forward -----------------------------------------------------------------------------------

    def route(self, x: torch.Tensor):
        """x [T, H] -> (topk_weights fp32 [T, k], topk_ids int64 [T, k], probs fp32 [T, E])."""
        logits = F.linear(x.float(), self.router.weight.float())
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.topk, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids, probs

    def capacity(self, tokens: int) -> int | None:
        """Slots an expert takes from this rank in a call of `tokens` tokens (None: no limit)."""
        if self.capacity_factor is None:
            return None
        return expert_capacity(tokens, self.topk, self.num_experts, self.capacity_factor)

    def row_bound(self, tokens: int) -> int | None:
        """The ops' max_rows for a call of `tokens` tokens per rank (None: the dynamic path)."""
        if self.max_rows == WORST_CASE:
            return worst_case_rows(tokens, self.topk, self.num_experts, self.world,
                                   tp_size=self.tp_size)
        if self.max_rows is not None:
            return None if self.max_rows < 0 else self.max_rows
        capacity = self.capacity(tokens)
        if capacity is None:
            return None
        return worst_case_rows(tokens, self.topk, self.num_experts, self.world, capacity,
                               self.tp_size)

    def shared_expert(self, tokens: torch.Tensor) -> torch.Tensor:
        """The shared expert alone on tokens [T, H] (None without one): SwiGLU MLP, times
        sigmoid(tokens shared_gate^T) when gated."""
        if self.shared_w0 is None:
            return None
        out = F.linear(swiglu(F.linear(tokens, self.shared_w0)), self.shared_w1)
        if self.shared_gate is not None:
            out = out * torch.sigmoid(F.linear(tokens, self.shared_gate))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"comet.nn.MoE: input has {shape[-1]} features, expected "
                             f"hidden_size={self.hidden_size}")
        tokens = x.reshape(-1, self.hidden_size).to(self.w0.dtype).contiguous()
        weights, routed_ids, probs = self.route(tokens)
        capacity = self.capacity(tokens.shape[0])
        ids = routed_ids if capacity is None else \
            drop_over_capacity(routed_ids, self.num_experts, capacity)
        kw = dict(group=self.group, buffer=self.buffer, n_comm=self.n_comm, tile=self.tile,
                  sm_margin=self.sm_margin)
        ready = sidestream.mark_ready(tokens) if self.shared_w0 is not None else None
        if self.fp8:  # master weights quantised per call, results in the module's dtype
            from comet import fp8

            layer0, layer1 = fp8.moe_layer0, fp8.moe_layer1
            kw["out_dtype"] = tokens.dtype
            place = {}
        else:
            layer0, layer1 = comet.moe_layer0, comet.moe_layer1
            place = {"placement": self.placement}
        # SwiGLU fused into layer0's epilogue (comet.moe_layer0(activation=)); the FP8 wrappers
        # take none, so there it runs on layer0's output.
        self.fused_activation = None if self.fp8 else "swiglu"
        act = {} if self.fp8 else {"activation": "swiglu"}
        y0, layout = layer0(tokens, self.w0, ids, num_experts=self.num_experts,
                            max_rows=self.row_bound(tokens.shape[0]), tp_size=self.tp_size,
                            **place, **act, **kw)
        # The shared expert between the two ops: beside the routed kernels on a CUDA side stream.
        shared = sidestream.run_beside(self.shared_expert, tokens, ready)
        h = y0 if self.fused_activation else swiglu(y0)
        out = layer1(h, self.w1, weights, layout, **kw)
        if shared is not None:
            out = out + sidestream.join(shared).to(out.dtype)
        self.aux_loss = None
        if self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            aux = self.aux_loss_coeff * load_balancing_loss(probs, routed_ids, self.num_experts)
            self.aux_loss = aux.detach()
            out = _AttachAuxLoss.apply(out, aux, float(self.aux_loss_scale))
        return out.reshape(shape).to(x.dtype)

    def _local_repr(self) -> str:
        if self.placement is None:
            return f"[{self.expert_offset}, {self.expert_offset + self.num_local_experts})"
        return str(list(self.local_experts))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts}, topk={self.topk}, world={self.world}, "
                f"local_experts={self._local_repr()}, renormalize={self.renormalize}, "
                f"aux_loss_coeff={self.aux_loss_coeff}, "
                f"shared_ffn_hidden_size={self.shared_ffn_hidden_size}, "
                f"shared_expert_gate={self.shared_gate is not None}, "
                f"capacity_factor={self.capacity_factor}, max_rows={self.max_rows!r}, "
                f"tp_size={self.tp_size}, fp8={self.fp8}, placement={self.placement!r}")


def allreduce_gradients(module: nn.Module, group=None) -> None:
    """Make a module's gradients those of the mean loss over the ranks of `group` (each rank's
    loss being the mean over its own tokens): replicated parameters (router, and anything that is
    not an expert weight) are averaged with all_reduce; expert-parallel weights already hold every
    rank's contribution, so they are only divided by the group size. No-op without a group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    for m in module.modules():
        if isinstance(m, MoE):
            sum_replica_gradients(m, group)
    for p in module.parameters():
        if getattr(p, "comet_expert_parallel", False):
            if p.grad is not None:
                p.grad.div_(world)
        elif p.requires_grad:
            if p.grad is None:  # every rank must take part in the all_reduce
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            p.grad.div_(world)


def sum_replica_gradients(moe: MoE, group=None) -> None:
    """With a placement that replicates experts: give every replica of an expert the sum of its
    replicas' w0 / w1 gradients (each replica's own covers only the rows it served), so replicas
    that start identical stay identical after the optimiser step. One all_reduce per call over the
    group: both weights' gradients scattered into a dense [E, ...] buffer by logical expert (zeros
    where this rank holds no replica), summed, and read back at this rank's slots; E x (|w0| +
    |w1|) / E_r elements, independent of how the replicas are spread. A no-op without replicas or
    without torch.distributed. allreduce_gradients calls it."""
    p = moe.placement
    if p is None or all(len(r) == 1 for r in p.expert_ranks):
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    ws = [moe.w0, moe.w1]
    for w in ws:
        if w.grad is None:
            w.grad = torch.zeros_like(w)
    sizes = [math.prod(w.shape[1:]) for w in ws]
    dense = torch.zeros(p.num_experts, sum(sizes), dtype=torch.float32, device=moe.w0.device)
    idx = torch.tensor(moe.local_experts, dtype=torch.long, device=dense.device)
    if len(idx):
        dense[idx] = torch.cat([w.grad.reshape(len(idx), -1).float() for w in ws], dim=1)
    dist.all_reduce(dense, op=dist.ReduceOp.SUM, group=group)
    if len(idx):
        mine = dense[idx]
        off = 0
        for w, n in zip(ws, sizes):
            w.grad.copy_(mine[:, off:off + n].reshape(w.shape).to(w.grad.dtype))
            off += n
