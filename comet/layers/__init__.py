"""The two fused ops: their Python entry points and fake kernels (ops), their backward formulas
(autograd, registered with torch.library on import) and the side stream the weight-gradient
GEMMs run on (sidestream)."""
from comet.layers.ops import Layout, moe_layer0, moe_layer1
from comet.layers import autograd  # noqa: F401  (registers the backward of both ops)

__all__ = ["Layout", "autograd", "moe_layer0", "moe_layer1"]
