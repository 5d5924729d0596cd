"""Expert tensor parallelism (``MoEShape.tp_size = t``, :func:`tp_traffic`): TP-innermost ranks,
``EP = W / t`` expert-parallel groups, each rank holding ``1 / t`` of every local expert's N
columns (``N`` is the shard).  Each layer has two ways to move its rows, derived below: layer0
sends every slot row to each of the t ranks ("direct") or each token once per EP rank and then
all-gathers inside the TP group ("group", MoNTA's split); layer1 sends t partial rows home
("direct") or reduce-scatters over H inside the group and sends H / t columns home ("group").
The model computes both paths' rows per link and takes the group path where its comm alone is
shorter by more than ``TP_PATH_SLACK``, else direct
(:func:`comet.tune.model.comm.choose_tp_path`, next to the comm time it compares); ``predict``
reports it.

Layout (docs/api.md): the W ranks are TP-innermost, rank r = ep * t + j (ep_rank = r // t,
tp_rank j = r % t), EP = W / t; the E / EP experts of EP rank ep live on all its t ranks, rank j
holding the j-th 1/t of each expert's N columns (w0 [E_l, N0/t, H], w1 [E_l, H, N1/t]).  Every
rank brings T tokens (sequence-parallel).  With several nodes the TP groups lie inside a node
(t divides P).  Per rank, uniform routing, rows of H elements per direction; p = 1 - C(E - E_l,
k) / C(E, k) with E_l = E / EP (a token's probability of a slot on a given EP rank, so EP * p is
the expected number of distinct EP ranks per token, <= k):

layer0 (every rank of EP rank ep needs all M = t T k slot rows routed to ep's experts):
  direct (built, csrc/include/comet/comm_layer0.h): each of the t ranks of an EP rank pulls a
          token once, however many of its slots land there, and fills the token's other slot
          rows locally.  A rank receives T p token rows from each source: over NVLink
          (P - 1) T p, over the NIC (W - P) T p; the rest of its M = W T k / EP slot rows are
          HBM copies (its own tokens' rows and the pulled tokens' extra slots).
  group (MoNTA's split: cross-group traffic once, then an all-gather inside the group): source
          (ep', j) sends each token once per EP rank it hits, to that EP rank's rank j (the same
          tp index: rail-aligned), into a token stage: T p rows per (source, EP rank); then each
          rank of the group pulls from its t - 1 peers the token rows they staged (EP T p
          each) and every rank expands its staged tokens into its slot rows (HBM).  Rows:
          own stage T p + expansion t T k (HBM copies, read + write), over NVLink
          (P / t - 1) T p (cross-group, same node) + (t - 1) EP T p (all-gather), over the NIC
          (W - P) / t * T p.  Two dependent hops: two link latencies.
  One node: NVLink rows direct T p (W - 1), group T p (W - 1): the same (both de-duplicate a
  token's slots per rank), the group path with a second hop and its staging copy.  Across
  nodes the group path's NIC rows are 1 / t of direct's: a token crosses once per EP rank, not
  once per tp rank (groups spanning nodes are refused with t > 1, so it is not built).

layer1 (rank (ep, j) has a partial of the output row of every token that hits ep, summed over
its local slots and its 1/t of N; the home needs the sum over the t ranks and the EP ranks):
  direct: every rank sends its partial row home: one per (token, home): local T p, over
          NVLink (P - 1) T p, over the NIC (W - P) T p; the home's combine sums t EP p T rows.
  group (reduce-scatter over H inside the TP group, then H / t columns home): rank j sends
          column block j' of each of its W T p partial rows to peer j' ((t - 1) / t W T p
          rows of NVLink), stages its own block (W T p / t rows, HBM write), sums the t blocks
          of each token (reads W T p rows' worth, HBM) and sends its H / t columns home: local
          T p / t, over NVLink (P - 1) T p / t, over the NIC (W - P) T p / t rows' worth; the
          home's combine sums EP p T rows.  Two dependent hops: two link latencies.
  One node: NVLink rows direct T p (W - 1), group T p (W - 1 / t): the group path moves more
  (the reduce-scatter) and costs HBM; it pays across nodes, where the NIC rows drop t-fold.

t = 1: both paths are the model without TP (EP = W, p = p_hit); the functions below are only
called for t > 1, so the model's predictions for t = 1 are unchanged bit for bit.

The choice (comet.tune.model.comm: :func:`choose_tp_path`): each path's comm alone on the whole GPU (every link and
the HBM side at its achievable rate, the links overlapping as in :func:`comm_time`); "group"
wins only when it is shorter by more than TP_PATH_SLACK, else "direct".  :func:`tp_alternatives` reports both paths' rows per link.
The pipeline (:func:`predict`) runs the chosen path's rows as today's streams: the group path's
all-gather (layer0) is treated as rows available from the start once its extra latency is paid,
which is optimistic about the second hop's dependency.
"""

from __future__ import annotations

from typing import Optional

from .shape import NodeTraffic, TP_PATHS, _check_layer, _link_elem_bytes, hit_probability

# The group path must beat direct's comm by more than this fraction to be chosen: its second hop
# depends on the first, which the pipeline treats optimistically (module doc), and it needs the
# TP group in step (a policy margin, not a measured constant).
TP_PATH_SLACK = 0.02

# The path comet's kernels implement (csrc/include/comet/comm_layer0.h, comm_layer1.h): layer0's
# tp ranks each pull a token once from its source, layer1's t partial rows all go home. The tuner
# prices real calls with it; "group" (MoNTA's split) is modelled for what it would save across
# nodes.
BUILT_TP_PATH = "direct"


def _tp_path(shape: "MoEShape") -> str:
    if shape.tp_path is None:
        raise ValueError("tp_size > 1 needs tp_path ('direct' or 'group'): pass it, or let "
                         "resolve_tp_path(shape, spec, layer) / predict / comm_time choose")
    return shape.tp_path


def tp_traffic(shape: "MoEShape", layer: int, path: Optional[str] = None) -> "NodeTraffic":
    """Rows (of H elements) one rank moves for ``layer`` with ``tp_size > 1`` on ``path``
    (default ``shape.tp_path``), as :class:`NodeTraffic` (see the derivation in the module doc): ``local`` the
    HBM copies (layer0: read + write each; layer1: partials homed here), ``same_node`` over
    NVLink (group path: the all-gather / reduce-scatter included), ``nic`` over the NIC."""
    _check_layer(layer)
    path = _tp_path(shape) if path is None else path
    if path not in TP_PATHS:
        raise ValueError(f"path={path!r}: expected one of {TP_PATHS}")
    W, P, t, EP = shape.W, shape.ranks_per_node, shape.tp_size, shape.ep_size
    T, k = shape.T, shape.k
    p = hit_probability(EP, shape.E, k)
    if layer == 0:
        if path == "direct":  # one row per (token, rank), the rest of the M slot rows local
            return NodeTraffic(W * T * k / EP - (W - 1) * T * p, (P - 1) * T * p, (W - P) * T * p)
        return NodeTraffic(T * p + t * T * k, (P // t - 1) * T * p + (t - 1) * EP * T * p,
                           (W - P) // t * T * p)
    if path == "direct":
        return NodeTraffic(T * p, (P - 1) * T * p, (W - P) * T * p)
    return NodeTraffic(T * p / t, (t - 1) / t * W * T * p + (P - 1) * T * p / t,
                       (W - P) * T * p / t)


def _tp_staging_bytes(shape: "MoEShape", layer: int) -> float:
    """HBM bytes of the comm blocks beyond :func:`tp_traffic`'s ``local`` rows: layer1's group
    path stages its own column block (W T p / t rows' worth written) and re-reads the t blocks
    (W T p rows' worth) before sending home."""
    if layer == 0 or _tp_path(shape) == "direct":
        return 0.0
    W, t = shape.W, shape.tp_size
    rows = W * shape.T * hit_probability(shape.ep_size, shape.E, shape.k)
    return (rows / t + rows) * shape.H * _link_elem_bytes(shape, 1)


def _tp_hops(shape: "MoEShape") -> int:
    """Dependent link latencies before the last row lands: 2 on the group path."""
    return 2 if shape.tp_size > 1 and _tp_path(shape) == "group" else 1


def _tp_combine_partials(shape: "MoEShape") -> float:
    """Partial rows (H elements' worth) the home's combine reads per rank with TP: t EP p T on the
    direct path (one per (token, rank of each EP rank hit)), EP p T on the group path."""
    ep_hits = shape.ep_size * shape.T * hit_probability(shape.ep_size, shape.E, shape.k)
    return ep_hits * (shape.tp_size if _tp_path(shape) == "direct" else 1)
