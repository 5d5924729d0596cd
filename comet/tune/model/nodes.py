"""The rows of a group that spans nodes, by link, in the cost model (comet.tune.perfmodel).

Several nodes (MoNTA-style: intra- and inter-node links separately, :func:`node_traffic`):
``MoEShape.ranks_per_node = P`` groups the ``W`` ranks into ``n = W / P`` nodes; same-node peers
are reached over NVLink by pointer, other nodes over the GPU's own NIC (one per GPU,
rail-aligned; ``GpuSpec.nic_gbs`` per direction, ``nic_eff``, ``nic_latency_us``).  Of the
``R`` remote rows above, ``R (P - 1) / (W - 1)`` stay in the node, ``F = R (W - P) / (W - 1)``
involve other nodes:

* layer0, node-first dispatch (csrc/include/comet/topology.h, ``node_first=True``): a token
  crosses to a remote node once if any of its k slots lands there, into the mirror on the relay
  (the rank of that node with the source's local index), then fans out inside the node.  NIC rows
  ``T (n - 1) q`` with ``q = 1 - C(E - E/n, k) / C(E, k)`` (:func:`hit_probability` with nodes
  for ranks: ``(n - 1) q`` is the expected number of distinct remote nodes per token), at most
  the flat ``F = T k (W - P) / W`` (union bound), strictly less for ``k >= 2`` with several
  experts per node.  The ``F`` slot rows are then read from mirrors: ``F (P - 1) / P`` over
  NVLink from a same-node relay, ``F / P`` from this rank's own mirror (HBM, read + write).
* layer0, flat (``node_first=False``, MoNTA's plain all-to-all): ``F`` slot rows over the NIC,
  fetched by the destination like a same-node pull (two index round trips over the NIC per
  m-tile), landing in place (no fan-out).
* layer1 per rank (``node_reduce=False``, the default): ``F`` partial rows over the NIC, one per
  (token, sending rank) to a home on another node, put by the comm blocks as they reduce (inside
  the fused kernel); results bitwise equal to one node.
* layer1 node-reduced (``node_reduce=True``, ``Buffer(node_reduce=True)``): the ``F`` rows go
  over NVLink (``F (P - 1) / P``) or into this rank's own stage (``F / P``) to the home's relay on
  this node; the relay sums them and puts one row per (token, node): ``T (n - 1) q`` NIC rows (as
  node-first layer0), at most ``F``.  The relay runs in the combine kernel after the fused
  kernel, on every SM, so its NIC time (at the full NIC rate) and the read of its staged rows
  (HBM) are added to the tail: fewer NIC bytes, but not overlapped with the GEMM.
* With one node (``P = W``, the default) nothing crosses a NIC and every formula below is the
  single-node one, bit for bit (tests/data/perfmodel_one_node.json holds its predictions).
* A measured ``remote_rows`` is split in the same proportions.

The comm blocks' NIC rate per block is :func:`block_nic_rate`; the NIC's part of the comm time and
node-first layer0's pipeline are in comet.tune.model.comm and comet.tune.model.pipeline.
"""

from __future__ import annotations

from .gemm import DEFAULT_TILE
from .hardware import GpuSpec
from .one_node import local_rows, remote_rows
from .shape import (MoEShape, NodeTraffic, _check_layer, _link_elem_bytes,
                    expected_distinct_ranks, hit_probability)
from .tp import _tp_path, tp_traffic

def expected_distinct_nodes(W: int, E: int, k: int, ranks_per_node: int) -> float:
    """Expected number of distinct nodes a token's top-k slots land on (uniform routing): a node
    hosts ``E / nodes`` experts, so this is :func:`expected_distinct_ranks` with nodes for ranks."""
    if ranks_per_node < 1 or W % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide W={W}")
    return expected_distinct_ranks(W // ranks_per_node, E, k)


def node_traffic(shape: MoEShape, layer: int) -> NodeTraffic:
    """Where this rank's rows go for ``layer`` (see :class:`NodeTraffic` and the module doc).

    With ``P = ranks_per_node``, ``n = W / P`` nodes and ``R`` = :func:`remote_rows` (rows to or
    from other ranks, any node): a share ``(P - 1) / (W - 1)`` of ``R`` stays in the node, the
    rest, ``F = R (W - P) / (W - 1)``, involves other nodes.  layer0 flat: ``F`` token rows (one
    per (token, remote rank)) over the NIC.  layer0 node-first: ``T (n - 1) q`` token rows over
    the NIC, ``q = 1 - C(E - E/n, k) / C(E, k)`` (a token's probability of a slot on a given
    node), i.e. ``F`` times ``(n - 1) q / ((W - P) p_hit)`` (<= 1); the ``F`` token rows are then
    read from mirrors, ``1 / P`` of them from this rank's own.  layer1:
    ``F`` partial rows over the NIC (one per (token, sending rank)); node-reduced, ``T (n - 1) q``
    (one per (token, node), sent by the relays) after ``F`` rows into the relays' stages.
    One node: ``same_node = R``, nothing else moves -- the single-node model unchanged.
    """
    _check_layer(layer)
    if shape.tp_size > 1:
        return tp_traffic(shape, layer)
    R = remote_rows(shape, layer)
    loc = local_rows(shape, layer)
    W, P = shape.W, shape.ranks_per_node
    if P == W:
        return NodeTraffic(loc, R, 0.0)
    same = R * (P - 1) / (W - 1)
    far = R * (W - P) / (W - 1)
    n = shape.nodes
    tokens_far = (n - 1) * hit_probability(n, shape.E, shape.k)  # expected remote nodes per token
    if layer == 1:
        if not shape.node_reduce:
            return NodeTraffic(loc, same, far)
        # F = T (W - P) p_hit expected (token, remote rank) entries; the relays send one row
        # per (token, node) of the homes they relay: T (n - 1) q per rank.
        entries_far = (W - P) * hit_probability(W, shape.E, shape.k)
        nic = far * tokens_far / entries_far if entries_far > 0 else 0.0
        return NodeTraffic(loc, same, nic, far * (P - 1) / P, far / P)
    if not shape.node_first:
        return NodeTraffic(loc, same, far)
    # F = T (W - P) p_hit (token, remote-node rank) rows read from mirrors; T (n - 1) q crossed
    ranks_far = (W - P) * hit_probability(W, shape.E, shape.k)
    nic = far * tokens_far / ranks_far if ranks_far > 0 else 0.0
    return NodeTraffic(loc, same, nic, far * (P - 1) / P, far / P)


def internode_rows(shape: MoEShape, layer: int) -> float:
    """Rows this rank moves over the NIC for ``layer`` (per direction)."""
    return node_traffic(shape, layer).nic


def intranode_rows(shape: MoEShape, layer: int) -> float:
    """Rows this rank moves over NVLink for ``layer`` (same-node peers and mirror reads)."""
    return node_traffic(shape, layer).nvlink


def internode_bytes(shape: MoEShape, layer: int) -> float:
    return internode_rows(shape, layer) * shape.H * _link_elem_bytes(shape, layer)


def intranode_bytes(shape: MoEShape, layer: int) -> float:
    return intranode_rows(shape, layer) * shape.H * _link_elem_bytes(shape, layer)


def block_nic_rate(shape: MoEShape, spec: GpuSpec, layer: int) -> float:
    """Bytes/s one comm block moves over the NIC for ``layer``.  Node-first layer0 and layer1:
    spec.block_nic_bw (the sender pushes rows it owns into a mirror with its own layout, or
    partials it has just reduced: no per-tile index round trips).  Flat layer0 (no node-first):
    the destination gets every slot row from its source as it pulls a same-node peer's, so per
    m-tile it first resolves the rows' origins over the NIC (two dependent round trips of
    2 * nic_latency_us), like :func:`block_link_rate`.  The TP group path (:func:`tp_traffic`)
    pushes token rows like node-first dispatch: spec.block_nic_bw."""
    _check_layer(layer)
    rate = spec.block_nic_bw
    if layer == 1 or shape.node_first or (shape.tp_size > 1 and _tp_path(shape) == "group"):
        return rate
    tile_bytes = DEFAULT_TILE[0] * shape.row_bytes
    return tile_bytes / (tile_bytes / rate + 2 * 2 * spec.nic_latency_us * 1e-6)
