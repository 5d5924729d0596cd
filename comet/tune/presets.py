"""The model shapes of the Comet paper's evaluation (docs/peers.md), one definition for the command
line (``python -m comet.tune --model``), its tables and the planners' table
(comet.plan.report): hidden H, ffn per expert, experts E, topk k. All three use a gated FFN, so
layer0 produces N0 = 2 * ffn columns and layer1 reduces N1 = ffn."""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

__all__ = ["MODELS", "MODEL_ALIASES", "layer_dims", "text_table"]

MODELS: Dict[str, Dict[str, object]] = {
    "mixtral": dict(H=4096, ffn=14336, E=8, k=2, gated=True, title="Mixtral-8x7B"),
    "qwen2": dict(H=2048, ffn=1408, E=64, k=4, gated=True, title="Qwen2-MoE"),
    "phi3.5": dict(H=4096, ffn=6400, E=16, k=2, gated=True, title="Phi-3.5-MoE"),
}
MODEL_ALIASES = {
    "mixtral-8x7b": "mixtral", "mixtral8x7b": "mixtral",
    "qwen2-moe": "qwen2", "qwen2moe": "qwen2", "qwen": "qwen2",
    "phi3.5-moe": "phi3.5", "phi-3.5": "phi3.5", "phi-3.5-moe": "phi3.5", "phi35": "phi3.5",
    "phi": "phi3.5",
}


def layer_dims(model: Dict[str, object]) -> Tuple[int, int]:
    """(N0, N1) for a model preset: N0 = layer0 output columns, N1 = layer1 reduction size."""
    ffn = int(model["ffn"])
    return (2 * ffn if model.get("gated", True) else ffn), ffn


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The plain-text table both print: right-aligned columns under a rule of dashes."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)
