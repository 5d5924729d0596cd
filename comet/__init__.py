"""Comet: fine-grained computation-communication overlapping for distributed MoE layers.

torch.ops.comet.moe_layer0 fuses the token dispatch with the first expert GEMM, moe_layer1 fuses
the second expert GEMM with the weighted top-k reduce and the combine. comet.moe_layer0/1 are the
validated Python entry points."""
from comet._native import _C  # noqa: F401
from comet.ops import Layout, moe_layer0, moe_layer1
from comet.plan import Placement
from comet.symm import Buffer, buffer_for

__all__ = ["Buffer", "Layout", "Placement", "buffer_for", "moe_layer0", "moe_layer1"]
__version__ = "0.1.0"
