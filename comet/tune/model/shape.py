"""The problem the cost model (comet.tune.perfmodel) prices: one rank's view of one layer
(:class:`MoEShape`, with the validation of its TP fields), the dtypes it knows, and what uniform
routing gives every part of the model: the probability that a token has a slot on a given rank
(:func:`hit_probability`), the GEMM rows per local expert (:func:`expert_rows`: measured where
``MoEShape.expert_rows`` is given -- the hook for skewed routing, whose per-rank rows
comet.plan.skew measures in), the record of rows by path (:class:`NodeTraffic`) and the bytes per
element of a row on the links (FP8: comet.tune.model.fp8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

from .fp8 import FP8_OUT_BYTES, fp8_scale_bytes

# "fp8": float8_e4m3fn or float8_e5m2 operands with float32 scales, one per 1 x 128 values of a
# row (x, h) and one per 128 x 128 block of a weight (the ops' format; see comet.tune.model.fp8).
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                  "float": "fp32", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "e4m3": "fp8",
                  "e5m2": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def dtype_name(dtype) -> str:
    """Canonical dtype name, "bf16", "fp16", "fp32" or "fp8" (torch names or a torch.dtype too)."""
    s = str(dtype).replace("torch.", "").strip().lower()
    s = _DTYPE_ALIASES.get(s, s)
    if s not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of bf16, fp16, fp32, fp8")
    return s


def dtype_bytes(dtype) -> int:
    """Bytes per element of ``dtype`` ("bf16"/"fp16"/"fp32"/"fp8", torch names or a torch.dtype)."""
    return DTYPE_BYTES[dtype_name(dtype)]

# The values of MoEShape.tp_path: the two ways rows reach a TP group (comet.tune.model.tp).
TP_PATHS = ("direct", "group")


@dataclass(frozen=True)
class MoEShape:
    """One rank's view of one layer.

    ``W`` ranks, ``E`` experts (``W`` divides ``E``), top-``k``, hidden size ``H`` (the width of
    every row that crosses the links), ``N`` the per-expert GEMM size that is not ``H`` (layer0:
    output columns ``N0``, e.g. ``2 * ffn`` for a gated FFN; layer1: reduction size ``N1 = ffn``),
    ``T`` tokens per rank, ``dtype_bytes`` per element (1: FP8 operands with their scales, see
    comet.tune.model.fp8).  Optional measurements replace the
    uniform-routing expectations: ``remote_rows`` (rows this rank moves over the links for this
    layer: layer0 rows received, layer1 partial rows sent) and ``expert_rows`` (GEMM rows of each
    local expert, ``E / W`` values).  ``partial_bytes`` is the element size of layer1's partial
    rows (default: ``dtype_bytes``).

    ``ranks_per_node`` groups the ranks into ``W / ranks_per_node`` nodes (rank r on node
    ``r // ranks_per_node``; default ``W``: one node, the model of a single NVLink domain).
    ``node_first`` (only used with several nodes) selects node-first dispatch: a token's row
    crosses to a remote node once, to the relay, and fans out inside that node
    (csrc/include/comet/topology.h); false models the flat all-to-all, every (token, slot) row
    over the NIC on its own.  ``node_reduce`` (only used with several nodes) models layer1's
    node-reduced combine (comet.tune.model.nodes).

    ``tp_size = t`` (expert tensor parallelism, :func:`tp_traffic`): the ``W`` ranks are
    TP-innermost, ``EP = W / t`` expert-parallel groups of ``t`` ranks; each rank holds a ``1 / t``
    shard of every expert of its EP rank, so ``N`` is then this rank's shard (``N0 / t`` or
    ``N1 / t``: the weight the rank holds, as the tuner's key sees it) and ``E_local = E / EP``.
    ``tp_path`` picks how rows reach the TP group: "direct" or "group" (None: the model picks,
    :func:`choose_tp_path`).  With ``t > 1`` the model has no node-first relay and no node-reduced
    combine (``node_first`` is set false; ``node_reduce`` and a measured ``remote_rows`` are
    refused): the "group" path is the TP layout's own de-duplication.  ``t = 1`` is the model
    without TP, unchanged.
    """

    W: int
    E: int
    k: int
    H: int
    N: int
    T: int
    dtype_bytes: int = 2
    remote_rows: Optional[float] = None
    expert_rows: Optional[Tuple[float, ...]] = None
    partial_bytes: Optional[int] = None
    ranks_per_node: Optional[int] = None
    node_first: bool = True
    node_reduce: bool = False
    tp_size: int = 1
    tp_path: Optional[str] = None

    def __post_init__(self):
        for f in ("W", "E", "k", "H", "N"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"MoEShape.{f} must be >= 1, got {getattr(self, f)}")
        if self.T < 0:
            raise ValueError(f"MoEShape.T must be >= 0, got {self.T}")
        _check_tp(self)
        if self.E % self.ep_size:
            raise ValueError(f"W={self.W}" + (f" / tp_size={self.tp_size}" if self.tp_size > 1 else "")
                             + f" must divide E={self.E}")
        if self.k > self.E:
            raise ValueError(f"k={self.k} exceeds E={self.E}")
        rpn = self.W if self.ranks_per_node is None else int(self.ranks_per_node)
        if rpn < 1 or self.W % rpn:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be >= 1 and divide W={self.W}")
        object.__setattr__(self, "ranks_per_node", rpn)
        object.__setattr__(self, "node_first", bool(self.node_first))
        object.__setattr__(self, "node_reduce", bool(self.node_reduce))
        if self.expert_rows is not None:
            object.__setattr__(self, "expert_rows", tuple(self.expert_rows))
            if len(self.expert_rows) != self.E_local:
                raise ValueError(
                    f"expert_rows has {len(self.expert_rows)} entries, expected "
                    f"E/{'W' if self.tp_size == 1 else 'EP'}={self.E_local}")

    @property
    def ep_size(self) -> int:
        """Expert-parallel groups: ``W / tp_size``."""
        return self.W // self.tp_size

    @property
    def E_local(self) -> int:
        return self.E // self.ep_size

    @property
    def is_fp8(self) -> bool:
        return self.dtype_bytes == 1

    @property
    def row_bytes(self) -> int:
        """Bytes of one input row (x, or a row on layer0's links): H elements, plus FP8's scales."""
        if self.is_fp8:
            return self.H * self.dtype_bytes + fp8_scale_bytes(self.H)
        return self.H * self.dtype_bytes

    @property
    def nodes(self) -> int:
        return self.W // self.ranks_per_node


def _check_tp(shape: "MoEShape") -> None:
    """MoEShape's validation of the TP fields (called from __post_init__)."""
    t = int(shape.tp_size)
    object.__setattr__(shape, "tp_size", t)
    if t < 1 or shape.W % t:
        raise ValueError(f"tp_size={shape.tp_size} must be >= 1 and divide W={shape.W}")
    if shape.tp_path is not None and shape.tp_path not in TP_PATHS:
        raise ValueError(f"tp_path={shape.tp_path!r}: expected one of {TP_PATHS} or None")
    if t == 1:
        return
    rpn = shape.W if shape.ranks_per_node is None else int(shape.ranks_per_node)
    if rpn >= 1 and rpn % t:
        raise ValueError(f"tp_size={t} must divide ranks_per_node={rpn} (a TP group inside a node)")
    if shape.node_reduce:
        raise ValueError("node_reduce with tp_size > 1 is not modelled")
    if shape.remote_rows is not None:
        raise ValueError("a measured remote_rows with tp_size > 1 is not modelled")
    object.__setattr__(shape, "node_first", False)


def hit_probability(W: int, E: int, k: int) -> float:
    """P(a token has at least one of its k distinct experts on a given rank) = 1 - C(E-E_l,k)/C(E,k)."""
    el = E // W
    if E - el < k:
        return 1.0
    return 1.0 - math.comb(E - el, k) / math.comb(E, k)


def expected_distinct_ranks(W: int, E: int, k: int) -> float:
    """Expected number of distinct ranks a token's top-k slots land on (uniform routing)."""
    return W * hit_probability(W, E, k)


def expert_rows(shape: MoEShape) -> Tuple[float, ...]:
    """GEMM rows per local expert: measured, else ``W * T * k / E`` each (uniform routing)."""
    if shape.expert_rows is not None:
        return tuple(float(r) for r in shape.expert_rows)
    return (shape.W * shape.T * shape.k / shape.E,) * shape.E_local


class NodeTraffic(NamedTuple):
    """Rows of ``H`` elements one rank's comm blocks move for a layer, by the path they take
    (expected under uniform routing, or scaled from the measured ``remote_rows``).

    ``local``: copied inside this GPU (layer0: its own tokens' rows into the shared tensor;
    layer1: partials homed here).  ``same_node``: over NVLink to / from the other ranks of the node
    (layer0 pulls, layer1 partial stores).  ``nic``: over the inter-node link, per direction
    (layer0: rows pushed to other nodes -- one per (token, remote node) with node-first dispatch,
    one per (token, slot) without; by symmetry also what arrives; layer1: partial rows to homes on
    other nodes).  ``fanout_nvlink`` / ``fanout_local``: layer0 with node-first dispatch, the
    slot rows of other nodes' tokens this rank reads from the mirror of a same-node relay (over
    NVLink) or from its own mirror (it is the relay); layer1 node-reduced, the partial rows for
    homes on other nodes this rank stores into a same-node relay's stage or its own.
    """

    local: float
    same_node: float
    nic: float
    fanout_nvlink: float = 0.0
    fanout_local: float = 0.0

    @property
    def nvlink(self) -> float:
        """All rows over NVLink: same-node peers plus mirror reads."""
        return self.same_node + self.fanout_nvlink


def _link_elem_bytes(shape: MoEShape, layer: int) -> float:
    """Bytes per element of a row on ``layer``'s links (FP8: layer0 rows carry their scales,
    layer1's partials are the bf16 output; comet.tune.model.fp8)."""
    if layer == 1 and shape.partial_bytes is not None:
        return shape.partial_bytes
    if shape.is_fp8:
        return shape.row_bytes / shape.H if layer == 0 else FP8_OUT_BYTES
    return shape.dtype_bytes


def _check_layer(layer: int) -> None:
    if layer not in (0, 1):
        raise ValueError(f"layer must be 0 or 1, got {layer!r}")
