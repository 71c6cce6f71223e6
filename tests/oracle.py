"""The tests' oracles: textbook sort-based sparsemax and entmax-1.5 in float64, and mismatch
reports."""

import torch

from flashmax.reference import sparsemax_sort
from flashmax.reference_entmax import entmax15_sort


def _sorted_oracle(sort_fn, x: torch.Tensor, dim: int) -> torch.Tensor:
    x = x.double()
    row_max = x.amax(dim, keepdim=True)
    bad = ~torch.isfinite(row_max)
    y = sort_fn(torch.where(bad, 0.0, x), dim)
    return torch.where(bad, torch.nan, y)


def oracle(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sparsemax in float64 by sorting; NaN slices where the contract says so."""
    return _sorted_oracle(sparsemax_sort, x, dim)


def entmax15_oracle(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """entmax-1.5 in float64 by sorting; NaN slices where the contract says so."""
    return _sorted_oracle(entmax15_sort, x, dim)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| over the finite part of ref, in float64."""
    finite = torch.isfinite(ref)
    diff = (y.double() - ref)[finite]
    return float(diff.norm() / ref[finite].norm().clamp_min(1e-300))


def assert_close_to_oracle(y: torch.Tensor, x: torch.Tensor, dim: int, rtol: float,
                           oracle_fn=oracle) -> None:
    ref = oracle_fn(x, dim)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(torch.isnan(y), torch.isnan(ref)), "NaN slices differ from the oracle"
    err = relative_error(y, ref)
    if err > rtol:
        worst = (y.double() - ref).abs().nan_to_num(0).argmax()
        raise AssertionError(
            f"relative error {err:.3g} > {rtol:.3g}; worst element {worst.item()} "
            f"got {y.flatten()[worst].item()!r} want {ref.flatten()[worst].item()!r}"
        )
