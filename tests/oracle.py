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


# Rows of bf16 values (exact in every float dtype) with an entry exactly at tau: the support's
# sum minus 1, over its size, lands on another entry. Exact arithmetic puts that entry outside
# the support (y = 0); tau rounded in fp32 (or fp64) used to leave it a few 1e-9 above 0, so the
# backward, which takes the support from y > 0, counted it in (found among 2M random bf16 rows).
ROWS_AT_TAU = (
    (-2.046875, 0.7421875, -0.85546875, -0.337890625, -0.99609375, 0.8984375, 0.875, 0.57421875,
     0.34765625, 0.57421875, 0.609375, 0.0498046875, -0.10546875, -1.09375, -0.39453125,
     0.921875),
    (0.88671875, -0.03857421875, 0.458984375, 0.703125, -0.61328125, -0.08544921875, -0.25, 0.5,
     -0.359375, 0.74609375, -1.0703125, -1.2109375, -1.640625, 0.326171875, -0.10595703125,
     -0.79296875),
    (1.2421875, 0.734375, 0.8828125, -0.97265625, -1.375, 1.3046875, -0.326171875, 0.240234375,
     -1.2734375, -1.2265625, -0.38671875, 1.0078125, -0.73046875, 0.9765625, -0.447265625,
     0.494140625),
)

# A row of fp32 values whose exact output holds an entry just above tau: 2^-24, computed exactly
# in fp32 too (its other support entry lies 1 - 2^-23 below the max), and inside v16's tie
# tolerance of 4 ulps of tau, which zeroes it (found by the sweep among 2M randn rows of 8:
# benchmarks/NOTES.md, v21).
ROW_JUST_ABOVE_TAU = tuple(float.fromhex(v) for v in (
    "-0x1.eba342p-2", "-0x1.512a36p+1", "0x1.beac4cp-2", "0x1.cff844p+0", "-0x1.ab62d2p-2",
    "-0x1.d9be14p-3", "0x1.9ff08cp-1", "-0x1.33f70ep-4"))


def support_gradient(x: torch.Tensor, g: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The sparsemax gradient g - mean of g over the oracle's support, on it (float64)."""
    s = (oracle(x, dim) > 0).double()
    g = g.double()
    return s * (g - (s * g).sum(dim, keepdim=True) / s.sum(dim, keepdim=True))
