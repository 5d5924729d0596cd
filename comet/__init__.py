"""Comet: fine-grained computation-communication overlapping for distributed MoE layers.

torch.ops.comet.moe_layer0 fuses the token dispatch with the first expert GEMM, moe_layer1 fuses
the second expert GEMM with the weighted top-k reduce and the combine. comet.moe_layer0/1 are the
validated Python entry points.

Where things live (public modules at the top, the parts grouped by role below them):
  comet.nn, comet.hf, comet.megatron  the integrations (a torch module, transformers, Megatron)
  comet.reference                     the pure-torch reference the tests compare against
  comet.demo                          python -m comet.demo, the main job
  comet.layers                        the two fused ops, their backward, the weight-gradient stream
  comet.buffers                       the symmetric buffers the ops communicate through
  comet.plan                          expert placement: Placement, routing loads, the planners
  comet.tune                          cost model, autotuner, profiling hooks, python -m comet.tune
"""
from comet._native import _C  # noqa: F401
from comet.buffers import Buffer, Traffic, buffer_for, required_bytes
from comet.layers import Layout, moe_layer0, moe_layer1
from comet.layers.autograd import defer_weight_grads
from comet.plan import Placement
from comet.tune import profiling as _profiling

# The autotuner's profiling hooks (comet.tune.tuner.PROFILERS) time these ops: installed here, so
# that they exist exactly when the compiled ops do.
_profiling.register()

__all__ = ["Buffer", "Layout", "Placement", "Traffic", "buffer_for", "defer_weight_grads", "moe_layer0", "moe_layer1",
           "required_bytes"]
__version__ = "0.1.0"
