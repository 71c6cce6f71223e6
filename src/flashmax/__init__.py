"""flashmax: exact sparse normalisers (sparsemax, entmax-1.5) on GPUs at the speed of a memory copy."""

from .entmax import Entmax15, entmax15
from .sparsemax import Sparsemax, sparsemax

__version__ = "0.1.0"

__all__ = ["Entmax15", "Sparsemax", "entmax15", "sparsemax", "__version__"]
