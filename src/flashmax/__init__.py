"""flashmax: exact sparse normalisers (sparsemax) on GPUs at the speed of a memory copy."""

from .sparsemax import Sparsemax, sparsemax

__version__ = "0.1.0"

__all__ = ["Sparsemax", "sparsemax", "__version__"]
