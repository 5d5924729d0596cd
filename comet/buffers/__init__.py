"""Symmetric memory the fused ops communicate through: the buffer of a process group (symm: the
CPU backend's shared-memory heap and what both backends share; symm_cuda: NVSHMEM on GPUs) and
how the group's ranks split into nodes (node_shape)."""
from comet.buffers.symm import Buffer, Traffic, buffer_for, required_bytes
from comet.buffers import symm_cuda  # noqa: F401 (registers Buffer.simulated_world's device="cuda")

__all__ = ["Buffer", "Traffic", "buffer_for", "required_bytes"]
