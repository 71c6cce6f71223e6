"""flashmax: exact sparse normalisers (sparsemax, entmax-1.5, alpha-entmax) on GPUs at the speed of a memory copy."""

from .entmax import Entmax15, entmax15
from .entmax_bisect import EntmaxBisect, entmax_bisect
from .losses import Entmax15Loss, SparsemaxLoss, entmax15_loss, sparsemax_loss
from .sparsemax import Sparsemax, sparsemax

__version__ = "0.1.0"

__all__ = [
    "Entmax15", "Entmax15Loss", "EntmaxBisect", "Sparsemax", "SparsemaxLoss",
    "entmax15", "entmax15_loss", "entmax_bisect", "sparsemax", "sparsemax_loss", "__version__",
]
