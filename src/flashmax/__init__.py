"""flashmax: exact sparse normalisers (sparsemax, entmax-1.5) on GPUs at the speed of a memory copy."""

from .entmax import Entmax15, entmax15
from .losses import Entmax15Loss, SparsemaxLoss, entmax15_loss, sparsemax_loss
from .sparsemax import Sparsemax, sparsemax

__version__ = "0.1.0"

__all__ = [
    "Entmax15", "Entmax15Loss", "Sparsemax", "SparsemaxLoss",
    "entmax15", "entmax15_loss", "sparsemax", "sparsemax_loss", "__version__",
]
