"""The rows one rank moves for a layer in one NVLink domain, the traffic every other part of the
cost model (comet.tune.perfmodel) prices:

Traffic (:func:`remote_rows`, :func:`local_rows`), uniform routing, top-k over distinct experts,
``E_l = E / W`` local experts, every rank holding ``T`` tokens:

* layer0 pulls one row of ``H`` elements per (token, remote rank) routed here, however many of
  the token's slots land here (csrc/include/comet/comm_layer0.h): ``R0 = T * (W - 1) * p_hit`` =
  ``T * d`` rows (below); the other ``M - R0`` slot rows (the local tokens' and the extra slots of
  the pulled ones) are copied into the shared tensor by the same comm blocks (HBM read + write).
* layer1 sends one partial row of ``H`` elements per (token, remote destination rank):
  ``R1 = T * (W - 1) * p_hit`` with ``p_hit = 1 - C(E - E_l, k) / C(E, k)`` the probability that a
  token has at least one slot on a given rank, i.e. ``R1 = T * d`` with ``d`` the expected number of
  distinct remote ranks per token.  Comm blocks also read all ``M = T * k`` GEMM output rows and
  write the ``T * p_hit`` local partials (HBM); the home rank finally sums its partials (HBM).
* The "2 * T * d * H * bytes / link_bw" of docs/peers.md ("The limit of overlap") is the two
  layers together: ``R0 + R1 = 2 * T * d``.
* Measured counts replace the expectations: ``MoEShape.remote_rows`` (rows this rank moves over the
  links for the layer) and ``MoEShape.expert_rows`` (GEMM rows per local expert).

With ``tp_size > 1`` the rows are those of the TP path (comet.tune.model.tp); over several nodes
comet.tune.model.nodes splits them by link.
"""

from __future__ import annotations

from typing import Optional

from .shape import MoEShape, _check_layer, _link_elem_bytes, expert_rows, hit_probability
from .tp import tp_traffic

def remote_rows(shape: MoEShape, layer: int, measured: Optional[float] = None) -> float:
    """Rows of ``H`` elements this rank moves over the links for ``layer`` (see module doc).

    layer0: ``T * (W - 1) * p_hit`` token rows received (one per (token, remote rank)); layer1:
    as many partial rows sent.  ``measured`` (or ``shape.remote_rows``) overrides the expectation.
    """
    _check_layer(layer)
    if measured is not None:
        return float(measured)
    if shape.remote_rows is not None:
        return float(shape.remote_rows)
    if shape.tp_size > 1:
        tr = tp_traffic(shape, layer)
        return tr.same_node + tr.nic
    W, T = shape.W, shape.T
    return T * (W - 1) * hit_probability(W, shape.E, shape.k)


def local_rows(shape: MoEShape, layer: int) -> float:
    """Rows the comm blocks handle inside this GPU: layer0 slot rows copied into the shared
    tensor locally (``M - remote``: the local tokens' and the extra slots of pulled tokens); layer1 partial rows whose home is this rank (``T * p_hit``)."""
    _check_layer(layer)
    if shape.tp_size > 1:
        return tp_traffic(shape, layer).local
    if layer == 0:
        return max(0.0, sum(expert_rows(shape)) - remote_rows(shape, 0))
    return shape.T * hit_probability(shape.W, shape.E, shape.k)


def traffic_bytes(shape: MoEShape, layer: int, measured: Optional[float] = None) -> float:
    """Bytes this rank moves over the links for ``layer``."""
    return remote_rows(shape, layer, measured) * shape.H * _link_elem_bytes(shape, layer)
