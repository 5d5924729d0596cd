"""Symmetric memory the fused ops communicate through: the buffer of a process group (symm: the
CPU backend's shared-memory heap and what both backends share; symm_cuda: NVSHMEM on GPUs) and
how the group's ranks split into nodes (node_shape)."""
from comet.buffers.symm import Buffer, Traffic, buffer_for, required_bytes

__all__ = ["Buffer", "Traffic", "buffer_for", "required_bytes"]
