"""flashmax: exact sparse normalisers (sparsemax) on GPUs at the speed of a memory copy."""

from .entmax_bisect import EntmaxBisect, entmax_bisect
from .sparsemax import Sparsemax, sparsemax

__version__ = "0.1.0"

__all__ = ["EntmaxBisect", "Sparsemax", "entmax_bisect", "sparsemax", "__version__"]
