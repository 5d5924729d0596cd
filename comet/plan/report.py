"""What the cost model predicts under skewed (Zipf) routing, contiguous vs planned placements:
the table of docs/placement.md (``python -m comet.plan.report`` prints it; tests/test_plan.py
checks the docs hold exactly this output) and the ``--skew`` section of ``python -m comet.tune``.

A model, not a measurement: the per-rank rows of :mod:`comet.plan.skew` priced by
:mod:`comet.tune.perfmodel`, each layer with the split that is best for its slowest rank.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional, Sequence

from comet.tune import perfmodel as pm
from comet.tune.presets import MODELS, text_table
from .balance import balance
from .load import zipf_loads
from .lysi import lysi_assign
from .placement import Placement
from .skew import choose_n_comm_slowest, predict_slowest, rank_shapes, slot_shares

__all__ = ["PLANNERS", "plan_for", "layer_times", "skew_rows", "skew_text", "markdown_table",
           "docs_table", "main"]

PLANNERS = ("contiguous", "balance", "lysi_assign")


def plan_for(planner: str, loads: Sequence[float], world: int, k: int,
             spare_slots: int = 1, ranks_per_node: Optional[int] = None) -> Placement:
    """The placement ``planner`` makes for ``loads`` on ``world`` equal GPUs, each with
    ``E / world + spare_slots`` expert slots (contiguous: today's map, no spare slot used).
    The planners see each expert's share of the slots (:func:`comet.plan.skew.slot_shares`)."""
    E = len(loads)
    if planner == "contiguous":
        return Placement.contiguous(E, world)
    shares = slot_shares(loads, k)
    slots = E // world + int(spare_slots)
    if planner == "balance":
        return balance(shares, world, slots, ranks_per_node)
    if planner == "lysi_assign":
        return lysi_assign([1.0] * world, shares, slots)
    raise ValueError(f"unknown planner {planner!r}; choose from {', '.join(PLANNERS)}")


def layer_times(model: Dict[str, object], spec: pm.GpuSpec, world: int, tokens: int,
                dtype_bytes: int, placement: Placement, loads: Sequence[float],
                ranks_per_node: Optional[int] = None) -> Dict[str, float]:
    """Both layers' predicted fused seconds on the slowest rank (each layer with the split best
    for its slowest rank) and the slowest rank's GEMM rows over the mean."""
    ffn = int(model["ffn"])
    dims = ((0, 2 * ffn if model.get("gated", True) else ffn), (1, ffn))
    out: Dict[str, float] = {}
    for layer, N in dims:
        shape = pm.MoEShape(W=world, E=int(model["E"]), k=int(model["k"]), H=int(model["H"]), N=N,
                            T=tokens, dtype_bytes=dtype_bytes, ranks_per_node=ranks_per_node)
        shapes = rank_shapes(shape, layer, placement, loads)
        n = choose_n_comm_slowest(shapes, spec, layer)
        p = predict_slowest(shapes, spec, n, layer)
        out[f"layer{layer}"] = p["fused"]
        out[f"n_comm{layer}"] = n
        out["rows_max_over_mean"] = p["rows_max_over_mean"]
    out["layer"] = out["layer0"] + out["layer1"]
    return out


def skew_rows(model: Dict[str, object], spec: pm.GpuSpec, world: int, tokens: int,
              dtype_bytes: int, exponents: Sequence[float], planners: Sequence[str] = PLANNERS,
              spare_slots: int = 1, ranks_per_node: Optional[int] = None,
              seed: int = 0) -> List[List[str]]:
    """Table rows (model, Zipf s, placement, max/mean rows, the two layers' n_comm, layer0 /
    layer1 / layer ms and the layer time over uniform routing's) for each exponent and planner."""
    E, k = int(model["E"]), int(model["k"])
    uniform = layer_times(model, spec, world, tokens, dtype_bytes, Placement.contiguous(E, world),
                          [1.0] * E, ranks_per_node)["layer"]
    rows = []
    for s in exponents:
        loads = zipf_loads(E, s, seed=seed)
        for planner in planners:
            placement = plan_for(planner, loads, world, k, spare_slots, ranks_per_node)
            t = layer_times(model, spec, world, tokens, dtype_bytes, placement, loads,
                            ranks_per_node)
            rows.append([str(model["title"]), f"{s:g}", planner, f"{t['rows_max_over_mean']:.2f}",
                         f"{t['n_comm0']} / {t['n_comm1']}", f"{t['layer0'] * 1e3:.3f}",
                         f"{t['layer1'] * 1e3:.3f}",
                         f"{t['layer'] * 1e3:.3f}", f"{t['layer'] / uniform:.2f}x"])
    return rows


def skew_text(model: Dict[str, object], spec: pm.GpuSpec, world: int, tokens: int,
              dtype_bytes: int, s: float, spare_slots: int = 1,
              ranks_per_node: Optional[int] = None) -> str:
    """``python -m comet.tune --skew zipf:<s>``'s section: each planner's slowest rank."""
    rows = skew_rows(model, spec, world, tokens, dtype_bytes, (s,), PLANNERS, spare_slots,
                     ranks_per_node)
    head = (f"Skewed routing, cost model (not measured): Zipf s={s:g} over the {model['E']} "
            f"experts (shuffled, seed 0); every rank runs the split that is best for the slowest "
            f"rank; planners get E/W + {spare_slots} slots per rank")
    return "\n".join([head, text_table(HEADERS[2:], [r[2:] for r in rows])])


HEADERS = ["model", "Zipf s", "placement", "max/mean rows", "n_comm", "layer0 ms", "layer1 ms",
           "layer ms", "vs uniform"]


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(HEADERS) + " |", "|---|--:|---|--:|--:|--:|--:|--:|--:|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def docs_table() -> str:
    """The table of docs/placement.md: the paper's three shapes on 8 x H800, 4096 tokens per
    rank, bf16, Zipf 1.0 and 1.5, one spare slot per rank for the planners."""
    spec = pm.get_spec("h800")
    rows = []
    for name in ("mixtral", "qwen2", "phi3.5"):
        rows += skew_rows(MODELS[name], spec, 8, 4096, 2, (1.0, 1.5))
    return markdown_table(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argparse.ArgumentParser(prog="python -m comet.plan.report",
                            description="Print docs/placement.md's table of predicted layer "
                                        "times under Zipf routing (cost model, not measured)."
                            ).parse_args(argv)
    print(docs_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
