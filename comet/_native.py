"""Loads comet._C (the compiled core) once; importing it registers torch.ops.comet.*."""
import torch  # noqa: F401  (loads libc10/libtorch, which comet._C links against)

try:
    from comet import _C  # noqa: F401  (registers the TORCH_LIBRARY on import)
except ImportError as e:  # pragma: no cover - only when the package was not built
    raise ImportError(
        "comet's compiled extension comet._C is missing or broken: install with "
        "`pip install --no-build-isolation -e .` after torch (README.md, \"Installing with pip\"), "
        "or `make setup`, first. Original error: " + str(e)) from e

__all__ = ["_C"]
