"""The Triton kernels against the fp64 oracle: under TRITON_INTERPRET=1 on the CPU (small shapes),
or compiled on a GPU with FLASHMAX_TEST_DEVICE=cuda (larger shapes, and through the public op)."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashmax import reference  # noqa: E402
from flashmax.kernels import entmax as entmax_kernels  # noqa: E402
from flashmax.kernels import sparsemax as kernels  # noqa: E402
from oracle import (ROW_JUST_ABOVE_TAU, ROWS_AT_TAU, assert_close_to_oracle,  # noqa: E402
                    entmax15_oracle, oracle, support_gradient)

DEVICE = os.environ.get("FLASHMAX_TEST_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"
# Interpreter programs run one after another in Python: keep the CPU shapes small.
ROWS = 64 if ON_GPU else 6
# Short widths reach each short-row launch (`rows_launch`): 8 and 16 one thread a row, 64 four
# threads, 100 eight (its alignment known to Triton only through ROW_ALIGN; 3 has none); 1000
# one row a program.
WIDTHS = ([1, 3, 8, 16, 64, 100, 1000, 4096, 32768, 100000] if ON_GPU
          else [1, 3, 8, 16, 64, 100, 1000, 4096])
POISON = 12345.0


def make(dist: str, rows: int, n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dist == "randn":
        x = torch.randn(rows, n, generator=g, dtype=torch.float64)
    elif dist == "rand":  # every entry within 1 of the max: many Newton steps
        x = torch.rand(rows, n, generator=g, dtype=torch.float64)
    elif dist == "tiny":
        x = torch.randn(rows, n, generator=g, dtype=torch.float64) * 1e-3
    elif dist == "huge":
        x = torch.randn(rows, n, generator=g, dtype=torch.float64) * 1e3
    elif dist == "offset":
        x = torch.randn(rows, n, generator=g, dtype=torch.float64) + 1e4
    elif dist == "ties":
        x = torch.randint(0, 4, (rows, n), generator=g).double() / 4 + 0.5
    elif dist == "masked":
        x = torch.randn(rows, n, generator=g, dtype=torch.float64)
        x[torch.rand(rows, n, generator=g) < 0.5] = -torch.inf
        x[:, 0] = 1.0  # keep every row finite somewhere
    elif dist == "near":  # every entry within 1e-6 of the max: the support is the whole row
        x = 1 - torch.rand(rows, n, generator=g, dtype=torch.float64) * 1e-6
    elif dist == "tied-max":  # a third of the entries tied at 3, at or near the max
        x = torch.randn(rows, n, generator=g, dtype=torch.float64)
        x[torch.rand(rows, n, generator=g) < 0.3] = 3.0
    elif dist == "two-values":  # about half of each row tied at the max, the rest 1 below
        x = torch.randint(0, 2, (rows, n), generator=g).double()
    else:
        raise ValueError(dist)
    return x.to(dtype).to(DEVICE)


def poisoned(t: torch.Tensor) -> torch.Tensor:
    return torch.full(t.shape, POISON, dtype=t.dtype, device=t.device)


def forward(x: torch.Tensor, dim: int = -1, **config) -> torch.Tensor:
    out = poisoned(x)
    y = kernels.sparsemax_forward(x, dim % x.dim(), out=out, **config)
    assert y is out
    assert not (y == POISON).any(), "some outputs were never written"
    return y


def backward(y: torch.Tensor, g: torch.Tensor, dim: int, **config) -> torch.Tensor:
    out = poisoned(y)
    dx = kernels.sparsemax_backward(y, g, dim, out=out, **config)
    assert dx is out
    assert not (dx == POISON).any(), "some gradients were never written"
    return dx


DISTS = ["randn", "rand", "tiny", "huge", "offset", "ties", "masked", "near", "tied-max",
         "two-values"]


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("dist", DISTS)
def test_forward_fp32_matches_oracle(dist, n):
    x = make(dist, ROWS, n, seed=n)
    x_before = x.clone()
    y = forward(x)
    assert torch.equal(x, x_before)
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6)
    assert torch.allclose(y.double().sum(-1), torch.ones(ROWS, dtype=torch.float64,
                                                          device=x.device), atol=1e-5)


# Rows in one thread (16), over 2 and 16 threads each (64, 300; these three many a tile,
# starting from their largest two), one a program, and one a program over HALF_ONE_ROW_WARPS';
# or split into chunks of at most 128 entries, at least two a row.
@pytest.mark.parametrize("n", [16, 64, 300, 1000, 4096])
@pytest.mark.parametrize("split", [False, True], ids=["in-registers", "split"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forward_half_is_fp32_rounded_once(dtype, split, n):
    x = make("randn", ROWS, n, dtype, seed=1)
    want = oracle(x.float().cpu()).to(dtype)
    got = forward(x, chunk=min(128, n // 2) if split else None).cpu()
    ulp = torch.finfo(dtype).eps
    assert torch.allclose(got.float(), want.float(), rtol=ulp, atol=ulp * 1e-3)


@pytest.mark.parametrize("n", [1000, 4096])  # 4096: one a program, 32 groups (`widest_group`)
def test_forward_fp64(n):
    x = make("randn", ROWS, n, torch.float64, seed=2)
    assert_close_to_oracle(forward(x).cpu(), x.cpu(), -1, rtol=1e-12)


@pytest.mark.parametrize(
    "config",
    [{"group": 1}, {"group": 4}, {"group": 8, "num_warps": 4}, {"group": 32, "block_m": 1},
     {"block_m": 4}, {"num_warps": 1}, {"num_warps": 2}, {"chunk": 256},
     {"chunk": 128, "group": 1}, {"chunk": 128, "sparse_write": 1},
     {"chunk": 128, "threshold_tile": 16},
     {"chunk": 64, "threshold_tile": 4}, {"programs_per_sm": 1},
     {"chunk": 128, "programs_per_sm": 0}, {"chunk": 256, "bound_groups": 0},
     {"chunk": 256, "bound_groups": 2}, {"chunk": 128, "early_zeros": 16},
     {"chunk": 128, "early_zeros": 0}],
    ids=["no-groups", "four-groups", "groups-across-warps", "thirty-two-groups", "four-rows",
         "one-warp", "two-warps", "split", "split-no-groups", "split-rereading-chunks",
         "split-row-tile-per-chunk", "split-row-tile-across-chunks", "prefetching",
         "split-chunk-a-program", "split-exact-bounds", "split-bounds-stopped-early",
         "split-early-zeros", "split-no-early-zeros"],
)
@pytest.mark.parametrize("dist", ["randn", "rand"])
def test_every_launch_path_is_exact(config, dist):
    x = make(dist, 2 * ROWS + 1, 1000, seed=3)  # row count not a multiple of BLOCK_M
    assert_close_to_oracle(forward(x, **config).cpu(), x.cpu(), -1, rtol=1e-6)


# Supports of hundreds of nearly tied entries, in each launch: a step's sum there is ~2 unless
# centred, and its rounding becomes the outputs' error (`_newton_update`'s MAX_DRIFT; found by
# a random search in session 33: 1e-6 to 3e-5 before, under the interpreter's sums).
@pytest.mark.parametrize("config", [{}, {"block_m": 4}, {"group": 2}, {"chunk": 512}],
                         ids=["one-a-program", "four-rows", "two-entry-groups", "split"])
@pytest.mark.parametrize("dist", ["near", "tied-max", "two-values"])
@pytest.mark.parametrize("n", [1000, 4096])
def test_nearly_tied_supports_are_exact(config, dist, n):
    x = make(dist, ROWS, n, seed=n + 1)
    assert_close_to_oracle(forward(x, **config).cpu(), x.cpu(), -1, rtol=2.5e-7)


# The random search that found them, kept: any launch override, width, row count and
# distribution (DISTS, scaled), fp32 and fp64, against the oracle with poisoned outputs.
LAUNCH_OVERRIDES = [{}, {"group": 1}, {"group": 2}, {"block_m": 4}, {"num_warps": 1},
                    {"programs_per_sm": 1}, {"chunk": 128}, {"chunk": 64, "threshold_tile": 4},
                    {"chunk": 128, "early_zeros": 16}, {"chunk": 256, "bound_groups": 0},
                    {"chunk": 128, "sparse_write": 1}, {"chunk": 128, "share_steps": 0},
                    {"chunk": 128, "prefilter_tile": 256},
                    {"chunk": 128, "early_zeros": 16, "prefilter_tile": 256}]


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(LAUNCH_OVERRIDES), dist=st.sampled_from(DISTS),
       rows=st.integers(1, 4), n=st.integers(1, 1200), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**31 - 1))
def test_property_any_launch_matches_oracle(config, dist, rows, n, scale, dtype, seed):
    if n <= 2 * config.get("chunk", n):  # the split launches need rows of two chunks or more
        config = {}
    x = (make(dist, rows, n, torch.float64, seed) * scale).to(dtype)
    assert_close_to_oracle(forward(x, **config).cpu(), x.cpu(), -1,
                           rtol=1e-6 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("dist", ["randn", "rand"])
def test_split_row_pass_wider_than_its_held_tile(dist):
    # Few rows' row pass reads 64 candidates of each of 128 chunks at a time, but holds a row
    # in registers only if each chunk has at most 32 (HELD_TILE): row 0's 40 nearly tied
    # entries in one chunk are read at each step, row 1's candidates held (randn).
    chunks = 128
    assert kernels.HELD_TILE // chunks < min(kernels.THRESHOLD_TILE[False] // chunks, 64)
    x = make(dist, 2, 128 * chunks, seed=25)
    x[0, 640:680] = x[0].max() + torch.linspace(0, 1e-3, 40, device=x.device)
    assert_close_to_oracle(forward(x, chunk=128).cpu(), x.cpu(), -1, rtol=1e-6)


# The interpreter runs a jit function from its source with its module's globals: a spy on one
# names the original and its record here.
_compacted_tile = kernels._compacted_tile
COMPACTIONS_FITTED = []


@triton.jit
def _recorded_compaction(*args):
    fits, z = _compacted_tile(*args)
    COMPACTIONS_FITTED.append(bool(fits))
    return fits, z


def spy_on_compaction(monkeypatch) -> list:
    """Under the interpreter, whether each row pass's compaction fitted
    (`_compacted_tile`), in launch order; on the GPU the list stays empty."""
    COMPACTIONS_FITTED.clear()
    if not ON_GPU:
        monkeypatch.setattr(kernels, "_compacted_tile", _recorded_compaction)
    return COMPACTIONS_FITTED


# Dense rows' candidates (all above each chunk's own bound) overflow the row pass's held tile;
# with compact_tile the pass keeps those above its Newton step's tau, in scratch in a chunk of
# y that pass 3 writes whole. A chunk of -inf (no candidates) and, with early zeros, chunks of
# at most 32 candidates are the roomiest but must not hold it: pass 3 writes only their
# candidates' slots, and the scratch would stay. Rows within 1e-6 (the whole row their
# support) overflow the compacted tile at every step, and are read at each.
@pytest.mark.parametrize("dist", ["rand", "rand-masked-chunk", "near"])
@pytest.mark.parametrize("config", [{}, {"early_zeros": 32}], ids=["rewritten", "early-zeros"])
def test_split_row_pass_compacts_dense_rows(monkeypatch, dist, config):
    fitted = spy_on_compaction(monkeypatch)
    rows, n, launch = ((3, 1 << 22, dict(compact_tile=8192)) if ON_GPU and dist != "near" else
                       (2, 8192, dict(chunk=512, threshold_tile=64, compact_tile=4096)))
    x = make(dist.split("-")[0], rows, n, seed=27)
    if dist == "rand-masked-chunk":
        chunk = launch.get("chunk", kernels.SPLIT_LAUNCH[False][0])
        x[:, chunk:2 * chunk] = -torch.inf
    y = forward(x, **launch, **config)
    assert fitted == ([] if ON_GPU else [dist != "near"] * rows), fitted
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_row_pass_compacts_by_default_only_4_byte_entries(monkeypatch, dtype):
    """The default compaction (SPLIT_COMPACT_TILE) applies to 4-byte entries: 2-byte rows lost
    with it."""
    fitted = spy_on_compaction(monkeypatch)
    x = make("rand", 1, 8192, dtype, seed=29)
    y = forward(x, chunk=512, threshold_tile=64)
    assert fitted == ([True] if dtype == torch.float32 and not ON_GPU else []), fitted
    assert_close_to_oracle(y.cpu().double(), x.cpu().double(), -1,
                           rtol=1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("tile", [16, 128])
def test_split_row_pass_compacts_once_they_fit(monkeypatch, tile):
    """Candidates above the start that overflow the compacted tile: each read keeps those
    above its tau until they fit. This uniform row of 4000 has 89 in its support and more
    than 128 above the start (a pass that compacts at the start only does not fit 128 here):
    128 fits from the second step on, 16 never and every step reads."""
    fitted = spy_on_compaction(monkeypatch)
    x = make("rand", 1, 4000, seed=28)
    y = forward(x, chunk=256, threshold_tile=64, compact_tile=tile)
    assert fitted == ([] if ON_GPU else [tile == 128]), fitted
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6)


_held_candidates = kernels._held_candidates
ROWS_HELD = []


@triton.jit
def _recorded_held(*args):
    held, z = _held_candidates(*args)
    ROWS_HELD.append(bool(held))
    return held, z


def spy_on_held_rows(monkeypatch) -> list:
    """Under the interpreter, whether each row pass (sparsemax's or entmax-1.5's) held its
    row's candidates in registers (`_held_candidates`), in launch order; on the GPU the list
    stays empty."""
    ROWS_HELD.clear()
    if not ON_GPU:
        monkeypatch.setattr(kernels, "_held_candidates", _recorded_held)
        monkeypatch.setattr(entmax_kernels, "_held_candidates", _recorded_held)
    return ROWS_HELD


# Dense rows' candidates overflow the row pass's held tile (64 here, 4 a chunk; ~32 each,
# randn's ~10); with prefilter_tile (1024 here, 64 a chunk) the chunks keep those above the
# start first, in scratch in chunks of y that pass 3 writes whole, and the row pass holds
# them (uniform rows keep 7-19 of each chunk's; with a chunk of -inf, which takes the share
# bound off the start, 20-38). Rows within 1e-6 (the whole row their support) keep all and
# are read at each step; chunks whose other zeros pass 1 wrote (early zeros) keep theirs
# where pass 1 stored them.
@pytest.mark.parametrize("dist", ["rand", "rand-masked-chunk", "randn", "near"])
@pytest.mark.parametrize("config", [{}, {"early_zeros": 32}], ids=["rewritten", "early-zeros"])
def test_split_row_pass_prefilters_dense_rows(monkeypatch, dist, config):
    held = spy_on_held_rows(monkeypatch)
    rows, n, launch = ((3, 1 << 22, dict(prefilter_tile=8192)) if ON_GPU and dist != "near" else
                       (2, 8192, dict(chunk=512, threshold_tile=64)))
    # The randn rows' supports lie one to a chunk: by default (v78) their row pass would hold
    # the chunks' maxima, not the candidates that this test asks the prefilter to keep.
    launch["maxima"] = False
    x = make(dist.split("-")[0], rows, n, seed=27)
    if dist == "rand-masked-chunk":
        chunk = launch.get("chunk", kernels.SPLIT_LAUNCH[False][0])
        x[:, chunk:2 * chunk] = -torch.inf
    if "prefilter_tile" not in launch:
        forward(x, **launch, **config)
        assert held == ([] if ON_GPU else [False] * rows), held
        held.clear()
        launch["prefilter_tile"] = 1024
    y = forward(x, **launch, **config)
    assert held == ([] if ON_GPU else [dist != "near"] * rows), held
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("launch, spy", [(dict(compact_tile=4096), spy_on_compaction),
                                         (dict(prefilter_tile=512), spy_on_held_rows)],
                         ids=["compact", "prefilter"])
def test_split_row_scratch_holds_every_dtype(monkeypatch, dtype, launch, spy):
    """The compacted or prefiltered candidates hold x's values in y's dtype, 2 to 8 bytes:
    the compaction fits, the prefiltered row is held."""
    recorded = spy(monkeypatch)
    x = make("rand", 1, 8192, dtype, seed=29)
    y = forward(x, chunk=512, threshold_tile=64, **launch)
    assert recorded == ([] if ON_GPU else [True]), recorded
    assert_close_to_oracle(y.cpu().double(), x.cpu().double(), -1,
                           rtol=1e-12 if dtype == torch.float64 else 1e-2)


def test_split_row_prefilter_overflowing_a_chunk_keeps_it_as_stored(monkeypatch):
    """A chunk of 512 whose 200 nearly tied candidates, all above the start, overflow the 112
    slots past them: the row pass reads that chunk's candidates where pass 1 stored them (too
    many to hold), the other chunks' kept ones."""
    held = spy_on_held_rows(monkeypatch)
    x = make("rand", 1, 8192, seed=30)
    x[0, 1024:1224] = 1.0 + torch.linspace(0, 1e-4, 200, dtype=x.dtype, device=x.device)
    y = forward(x, chunk=512, threshold_tile=64, prefilter_tile=512)
    assert held == ([] if ON_GPU else [False]), held
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6)


@pytest.mark.parametrize("dist", ["rand", "randn"])
def test_entmax15_split_row_pass_prefilters_dense_rows(monkeypatch, dist):
    """entmax-1.5's row pass over the candidates above its start (its tau in x - max is at
    least -2), held as sparsemax's are (a tile of 2048 here, 128 a chunk): uniform rows keep
    58-85 of each chunk's ~150 candidates (the support ~60 a chunk)."""
    held = spy_on_held_rows(monkeypatch)
    # Under the interpreter bound_groups scales with the chunk too: with 128 a uniform chunk's
    # ~130 of 256 group maxima above its bound would not always count it dense (`_dense_chunk`).
    rows, n, launch = ((3, 1 << 22, dict(prefilter_tile=8192)) if ON_GPU else
                       (1, 8192, dict(chunk=512, threshold_tile=64, bound_groups=16)))
    x = make(dist, rows, n, seed=31)
    if not ON_GPU:
        entmax_kernels.entmax15_forward(x, 1, out=poisoned(x), prefilter_tile=0, **launch)
        assert held == [False] * rows, held
        held.clear()
        launch["prefilter_tile"] = 2048
    y = entmax_kernels.entmax15_forward(x, 1, out=poisoned(x), **launch)
    assert not (y == POISON).any(), "some outputs were never written"
    assert held == ([] if ON_GPU else [True] * rows), held
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6, oracle_fn=entmax15_oracle)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, kernels.SPLIT_MANY_ROWS])
def test_entmax15_split_row_pass_prefilters_by_default(monkeypatch, dtype, rows):
    """entmax-1.5's default prefilter (its `prefilter_tiles`, a tile of 8192 here 256 a chunk)
    applies to 4-byte entries and to 2-byte ones below SPLIT_MANY_ROWS rows, as timed: those
    uniform rows are held, the others read."""
    held = spy_on_held_rows(monkeypatch)
    x = make("rand", rows, 8192 // rows, dtype, seed=32)
    y = entmax_kernels.entmax15_forward(x, 1, out=poisoned(x), chunk=512, threshold_tile=64)
    assert not (y == POISON).any(), "some outputs were never written"
    prefiltered = dtype == torch.float32 or rows < kernels.SPLIT_MANY_ROWS
    assert held == ([] if ON_GPU else [prefiltered] * rows), held
    assert_close_to_oracle(y.cpu().double(), x.cpu().double(), -1,
                           rtol=1e-6 if dtype == torch.float32 else 1e-2,
                           oracle_fn=entmax15_oracle)


def test_split_row_prefilter_is_not_with_compaction():
    x = make("rand", 1, 4096)
    with pytest.raises(ValueError, match="prefilter_tile and compact_tile"):
        forward(x, chunk=512, compact_tile=1024, prefilter_tile=256)


@triton.jit
def _entmax_sums_kernel(Z, TAU, CENTRE, OUT, N: tl.constexpr):
    z = tl.reshape(tl.load(Z + tl.arange(0, N)), [1, 1, N])
    tau = tl.load(TAU + tl.arange(0, 1))
    centre = tl.load(CENTRE + tl.arange(0, 1))
    s1, s2, count, smallest = entmax_kernels._entmax_sums(z, tau, centre)
    tl.store(OUT + tl.arange(0, 1), s1)
    tl.store(OUT + 1 + tl.arange(0, 1), s2)
    tl.store(OUT + 2 + tl.arange(0, 1), count)
    tl.store(OUT + 3 + tl.arange(0, 1), smallest)


@pytest.mark.parametrize("at_tau", [False, True], ids=["none-at-tau", "one-at-tau"])
def test_entmax_step_sums_and_smallest_entry(at_tau):
    # A step's sums over d = z - tau > 0 (`_entmax_sums`, without selects) and the smallest d
    # the exactness test compares the closed form with: the smallest positive d, or 0 where an
    # entry lies at tau itself (never above the smallest positive d, so the test cannot pass on
    # it wrongly); -inf entries take no part.
    z = torch.tensor([-0.125, -0.4375, -0.25, -float("inf"), -2.0, -0.5, -0.75, 0.0])
    tau, centre = -0.5, 0.25
    if not at_tau:
        z[5] = -0.625
    d = (z - tau).double()
    inside = d[d > 0]
    out = torch.full((4,), POISON, device=DEVICE)
    _entmax_sums_kernel[(1,)](z.to(DEVICE), torch.tensor([tau], device=DEVICE),
                              torch.tensor([centre], device=DEVICE), out, z.numel())
    s1, s2, count, smallest = out.double().cpu().tolist()
    assert (s1, count) == (inside.sum().item(), inside.numel())
    assert s2 == (inside**2 - centre).sum().item()
    assert smallest == (0.0 if at_tau else inside.min().item())


@triton.jit
def _row_start_kernel(PART, OUT, n_splits, SPLITS: tl.constexpr, FLOOR: tl.constexpr,
                      SUBSET_BOUND: tl.constexpr):
    row = tl.program_id(0)
    start = kernels._split_row_start(PART, row, n_splits, SPLITS, tl.float32, FLOOR,
                                     SUBSET_BOUND)[1]
    tl.store(OUT + row + tl.arange(0, 1), start)


def split_row_starts(split) -> torch.Tensor:
    """Each row's start in x - max as the row pass takes it (`_split_row_start`), float64."""
    out = torch.empty(split.n_rows, device=split.part.device)
    _row_start_kernel[(split.n_rows,)](split.part, out, split.n_splits,
                                       split.row_pass["SPLITS"], split.lowest_threshold,
                                       split.subset_bound)
    return out.double().cpu()


def split_rows_of(op: str, x: torch.Tensor, chunk: int, **launch):
    """The op's split launch over x's rows, in chunks of `chunk`, into a poisoned output."""
    split_rows = kernels.SplitRows if op == "sparsemax" else entmax_kernels.Entmax15SplitRows
    y, rows, n_rows, n, inner, x_strides, y_strides, chunk = kernels._rows(x, poisoned(x), 1,
                                                                           chunk)
    return split_rows(rows, y, n_rows, n, inner, x_strides, y_strides, chunk, False, **launch)


@pytest.mark.parametrize("op", ["sparsemax", "entmax15"])
@pytest.mark.parametrize("dist", ["rand", "randn", "tiny", "offset", "ties", "masked",
                                  "rand-masked-chunk"])
@pytest.mark.parametrize("share_steps", [1, 3])
def test_split_row_start_is_a_lower_bound(op, dist, share_steps):
    # The row pass starts from the larger of the chunks' best bound and the smallest of their
    # share bounds (`_split_row_start`, with its margin): at or below the row's tau in x - max
    # (fp64), else Newton would stop on part of the support. On rows whose chunks are alike
    # (uniform values) 3 steps take the share bound above the best chunk bound on most rows
    # (not all: 63 of the GPU's 64 here; 1 step, with 32 chunks of 128, fewer); a chunk of
    # -inf alone holds no share. The exact tau of the chunks' maxima, a subset of the row, is
    # a lower bound too, and the kernel's start is at least it (less its margin).
    from flashmax import reference_entmax
    from flashmax.kernels import entmax as entmax_kernels

    # Under the interpreter two rows where the split rows are also written: entmax-1.5's row
    # pass over these dense rows takes ~40 s a row there (few rows either way: below 8).
    row_count = 2 if dist == "rand-masked-chunk" and not ON_GPU else ROWS
    x = make(dist.split("-")[0], row_count, 4096, seed=26)
    if dist == "rand-masked-chunk":
        x[:, 256:384] = -torch.inf
    # Uniform rows with exact chunk bounds (bound_groups=0): only chunks with more than
    # bound_groups group maxima above their bound take the share steps (`_dense_chunk`), which
    # sparsemax's 16 a chunk here need not have.
    split = split_rows_of(op, x, 128, share_steps=share_steps,
                          bound_groups=0 if dist == "rand" else None)
    y, n_rows = split.y, split.n_rows
    split.bounds()
    part = split.part.view(n_rows, split.n_splits, -1).double().cpu()
    chunk_max = part[..., kernels.PART_MAX.value]
    row_max = chunk_max.amax(-1, keepdim=True)
    offset = torch.where(chunk_max > -torch.inf, chunk_max - row_max, -torch.inf)
    floor = -1.0 if op == "sparsemax" else -2.0
    bound = (offset + part[..., kernels.PART_BOUND.value]).clamp_min(floor).amax(-1)
    share = (offset + part[..., kernels.PART_SHARE.value]).clamp_min(floor).amin(-1)
    start = torch.maximum(bound, share * (1 + kernels.CANDIDATE_MARGIN.value))
    z = x.double().cpu() - row_max
    if op == "sparsemax":
        tau = sum(reference.threshold(z))
    else:
        tau = 2 * sum(reference_entmax.entmax15_threshold(z / 2, torch.full((n_rows,), -1.0,
                                                                             dtype=z.dtype)))
    assert (start <= tau).all(), (start - tau)
    if op == "sparsemax":
        maxima_tau = sum(reference.threshold(offset))
    else:
        maxima_tau = 2 * sum(reference_entmax.entmax15_threshold(
            offset / 2, torch.full((n_rows,), -1.0, dtype=z.dtype)))
    kernel_start = split_row_starts(split)
    assert (kernel_start <= tau).all(), (kernel_start - tau)
    assert (kernel_start >= torch.maximum(start, maxima_tau) - 4e-6).all(), (
        kernel_start - torch.maximum(start, maxima_tau))
    if dist == "rand" and share_steps == 3:
        assert (share > bound).double().mean() >= 0.9, (share - bound)
    if dist == "rand-masked-chunk":
        assert (share == floor).all(), share
    if dist == "rand-masked-chunk" and share_steps == 3:
        # Written with the more stepped share bounds only (see the row count above).
        split.write(split.threshold())
        assert not (y == POISON).any(), "some outputs were never written"
        assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6,
                               oracle_fn=oracle if op == "sparsemax" else entmax15_oracle)


@pytest.mark.parametrize("dist", ["randn", "ties", "masked", "tied-max"])
def test_split_pass_one_stores_each_chunks_second(dist):
    # PART_SECOND: each chunk's second largest entry, the max itself where two tie at it, -inf
    # in a chunk of one finite entry or none; the last chunk is partial (1000 = 7 x 128 + 104).
    x = make(dist, ROWS, 1000, seed=28)
    x[:, 128:256] = -torch.inf
    x[:, 300] = x[:, 301] = 50.0
    x[:, 520] = 40.0
    x[:, 512:520] = -torch.inf
    x[:, 521:640] = -torch.inf
    split = split_rows_of("sparsemax", x, 128, maxima=True)
    split.bounds()
    second = split.part.view(ROWS, split.n_splits, -1)[..., kernels.PART_SECOND.value]
    padded = torch.nn.functional.pad(x, (0, split.n_splits * 128 - 1000), value=-torch.inf)
    expected = padded.view(ROWS, split.n_splits, 128).topk(2, -1).values[..., 1]
    assert torch.equal(second.cpu(), expected.cpu()), (second - expected)
    assert (second[:, 2] == 50.0).all() and (second[:, 1] == -torch.inf).all()
    assert (second[:, 4] == -torch.inf).all()


@pytest.mark.parametrize("maxima", [True, False], ids=["maxima", "candidates"])
def test_split_row_pass_reads_no_candidate_where_the_maxima_hold_the_support(maxima):
    # Row 0's support is four peaks in four chunks, every other entry below them by 2.5: no
    # chunk's second (PART_SECOND) lies above the row pass's start, so every entry above it is
    # a chunk's max, and with `maxima` the row pass takes its steps over the maxima alone
    # (`_held_candidates`). Then its outputs are exact though the candidates that pass 1 stored
    # in y are poisoned before the row pass (and restored for the write pass, which reads them
    # too). Row 1 puts two of the peaks in one chunk: its row pass reads the candidates, and
    # the poison reaches it, as it reaches row 0 without `maxima`.
    chunk = 128
    x = make("randn", 2, 32 * chunk, seed=29) * 0.1
    peaks = torch.tensor([3.0, 3.1, 3.2, 3.3], device=x.device)
    x[0, [5, 5 * chunk + 7, 9 * chunk + 100, 20 * chunk + 64]] = peaks
    x[1, [5, 5 * chunk + 7, 5 * chunk + 100, 20 * chunk + 64]] = peaks
    split = split_rows_of("sparsemax", x, chunk, maxima=maxima)
    y = split.y
    split.bounds()
    stored = y.clone()
    y.fill_(POISON)
    state = split.threshold()
    y.copy_(stored)
    split.write(state)
    assert not (y == POISON).any(), "some outputs were never written"
    want = oracle(x.double().cpu(), -1)
    poisoned_rows = [1] if maxima else [0, 1]
    for row in range(2):
        close = torch.allclose(y[row].double().cpu(), want[row], rtol=1e-6, atol=0)
        assert close != (row in poisoned_rows), (row, (y[row].double().cpu() - want[row]))


def test_split_rows_take_the_maxima_by_default_where_measured():
    # SPLIT_MAXIMA_SUPPORT: 4-byte entries below SPLIT_MANY_ROWS rows; not entmax-1.5.
    many = kernels.SPLIT_MANY_ROWS
    for op, rows, dtype, expected in [("sparsemax", 1, torch.float32, True),
                                      ("sparsemax", many - 1, torch.float32, True),
                                      ("sparsemax", many, torch.float32, False),
                                      ("sparsemax", 1, torch.bfloat16, False),
                                      ("entmax15", 1, torch.float32, False)]:
        split = split_rows_of(op, torch.ones(rows, 256, dtype=dtype, device=DEVICE), 128)
        assert split.maxima is expected, (op, rows, dtype)


@pytest.mark.parametrize("config", [{}, {"sparse_write": 1}, {"early_zeros": 32}],
                         ids=["sparse", "rereading", "early-zeros"])
def test_chunks_without_candidates(config):
    # Whole chunks below max - 1 hold no support: they must neither stall nor bias the bound.
    x = make("randn", ROWS, 1000, seed=18)
    x[:, :512] -= 10
    x[:, 700:] -= 10
    y = forward(x, chunk=128, **config)
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_chunks_too_full_to_store_candidates(dtype):
    # Rows of mostly tied maxima: over half of a chunk are candidates, which it cannot store;
    # passes 2 and 3 read such chunks whole. Mixed with chunks that do store theirs.
    x = make("randn", ROWS, 1000, dtype, seed=19)
    x[:, :600] = torch.where(x[:, :600] > -0.5, 3.0, x[:, :600])
    y = forward(x, chunk=128)
    assert_close_to_oracle(y.cpu().double(), x.cpu().double(), -1,
                           rtol=1e-6 if dtype != torch.bfloat16 else 1e-2)
    assert torch.equal(y, forward(x, chunk=128, sparse_write=1))
    assert torch.equal(y, forward(x, chunk=128, programs_per_sm=0))
    # Pass 1 writing the zeros of chunks with few candidates (here any of them but the full).
    assert torch.equal(y, forward(x, chunk=128, early_zeros=64))
    # Exact chunk bounds: fewer candidates, the same support.
    assert_close_to_oracle(forward(x, chunk=128, bound_groups=0).cpu().double(),
                           x.cpu().double(), -1, rtol=1e-6 if dtype != torch.bfloat16 else 1e-2)


@pytest.mark.parametrize("block_m", [1, 4])
@pytest.mark.parametrize("dist", ["randn", "rand", "masked"])
def test_prefetching_programs_walk_every_block(block_m, dist):
    # One program per multiprocessor walks several blocks (with block_m 4, the last one partly
    # past the rows).
    sms = kernels._multiprocessors(torch.device(DEVICE))
    x = make(dist, block_m * (3 * sms + 1) - 1, 300, seed=20)
    assert kernels.rows_launch(x, x.shape[0], 300, block_m=block_m, programs_per_sm=1)[4]
    y = forward(x, block_m=block_m, programs_per_sm=1)
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6)
    assert torch.equal(y, forward(x, block_m=block_m, programs_per_sm=0))


def test_launch_heuristic():
    # No program walks several blocks (and prefetches) unless programs_per_sm asks (NOTES v30,
    # v89). Rows of 2048 to 8192 entries take one warp per 2048 of them, longer ones one per
    # 4096.
    from flashmax.kernels import entmax

    x = make("randn", 2, 8, seed=21)
    sms = kernels._multiprocessors(torch.device(DEVICE))
    for n, want_warps in [(512, 1), (1024, 1), (2048, 1), (4096, 2), (8192, 4), (16384, 4),
                          (32768, 8)]:
        launch = kernels.rows_launch(x, 64 * sms, n)
        assert not launch.prefetch and launch.num_warps == want_warps, (n, launch)
        walking = kernels.rows_launch(x, 64 * sms, n, programs_per_sm=2)
        assert walking.prefetch and walking.programs == 2 * sms, (n, walking)
    # Sparsemax's forward holds 2-byte rows of 4096 entries over 4 warps; fp32 rows keep 2.
    for dtype, want_warps in [(torch.bfloat16, 4), (torch.float16, 4), (torch.float32, 2)]:
        launch = kernels.rows_launch(x.to(dtype), 64 * sms, 4096,
                                     half_warps=kernels.HALF_ONE_ROW_WARPS)
        assert launch.num_warps == want_warps, (dtype, launch)
    # entmax-1.5's holds 2-byte rows of 16384 entries (past ONE_ROW_WIDEST) over 8 warps, as
    # 12000 pads to; its other widths and fp32 rows keep the default's.
    for dtype, n, want_warps in [(torch.bfloat16, 16384, 8), (torch.float16, 12000, 8),
                                 (torch.float32, 16384, 4), (torch.bfloat16, 8192, 4),
                                 (torch.bfloat16, 32768, 8), (torch.bfloat16, 4096, 2)]:
        launch = kernels.rows_launch(x.to(dtype), 64 * sms, n,
                                     half_warps=entmax.HALF_ONE_ROW_WARPS)
        assert launch.num_warps == want_warps and launch.block_m == 1, (dtype, n, launch)
    # Its rows of 4096+ entries held one a program take the widest group whose chunks span the
    # layout (one 16-byte vector a thread), up to 32; shorter rows and other kernels up to 8.
    for dtype, n, want_group in [(torch.float32, 2048, 8), (torch.float32, 4096, 16),
                                 (torch.float32, 8192, 16), (torch.float32, 16384, 32),
                                 (torch.float32, 32768, 32), (torch.bfloat16, 4096, 4),
                                 (torch.bfloat16, 8192, 8), (torch.bfloat16, 32768, 16)]:
        launch = kernels.rows_launch(x.to(dtype), 64 * sms, n,
                                     half_warps=kernels.HALF_ONE_ROW_WARPS,
                                     wide_groups_from=kernels.WIDE_GROUPS_FROM)
        assert launch.group == want_group, (dtype, n, launch)
        assert kernels.rows_launch(x.to(dtype), 64 * sms, n).group <= kernels.GROUP_WIDEST


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_short_rows_launch(dtype):
    # Rows of up to 1 KB are spread over ROW_THREADS threads each, in chunks of one 16-byte
    # vector, one warp a program holding as many rows as it has thread-groups; longer rows take
    # one row a program. Each row's chunks stay in its threads (`_load_raw_rows`).
    x = torch.empty(0, dtype=dtype)
    vector = 16 // x.element_size()
    for n in [1, 3, 8, 16, 24, 64, 100, 256, 512, 1024, 2048]:
        launch = kernels.rows_launch(x, 1000, n)
        row_bytes = launch.block_n * x.element_size()
        if row_bytes > 1024:
            assert launch.block_m == 1, (n, launch)
            continue
        threads = launch.block_n // launch.group // min(vector, launch.block_n)
        want = max(kernels.ROW_THREADS[max(16, row_bytes)],
                   launch.block_n // kernels.ROW_THREAD_ENTRIES)
        assert threads == min(want, launch.block_n), (n, launch)
        assert launch.block_m * threads == 32 * launch.num_warps == 32, (n, launch)
        assert launch.thread_rows == (threads == 1), (n, launch)
        # Rows that one access reads fewer entries of: chunks of that many, as many threads.
        for align in (1, 2):
            narrow = kernels.rows_launch(x, 1000, n, align=align)
            assert narrow.block_m == launch.block_m, (n, align, narrow)
            assert narrow.block_n // narrow.group == min(threads * align, launch.block_n)
            assert narrow.thread_rows == (threads == 1 or launch.block_n <= align)
    assert not kernels.rows_launch(x, 1000, 16, block_m=8).thread_rows  # overrides keep theirs


def test_row_align():
    # The entries that divide n and every row's start, up to a 16-byte vector's; an odd stride
    # or row length leaves 1.
    x = torch.empty(0)
    assert kernels.row_align(x, 8, (8, 0, 1), (8, 0, 1)) == 4
    assert kernels.row_align(x, 6, (6, 0, 1), (8, 0, 1)) == 2
    assert kernels.row_align(x, 8, (9, 0, 1), (8, 0, 1)) == 1
    assert kernels.row_align(x, 8, (8, 0, 1), (16, 3, 1)) == 1
    assert kernels.row_align(x.to(torch.bfloat16), 24, (24, 0, 1), (48, 0, 1)) == 8
    assert kernels.row_align(x, 8, (8, 0, 1), (1, 8, 8)) == 1  # entries not adjacent


@pytest.mark.parametrize("op", ["sparsemax", "entmax15"])
def test_repeated_calls_match_fresh_launches(op):
    # On a GPU, calls with the launchers' defaults keep their launch and replay it on later
    # calls with the same key (flashmax.kernels.launch); a call with `out` never does. Layouts
    # that differ only in 16-byte alignment, in strides, or by a copy must not share a launch.
    from flashmax.kernels import entmax

    fwd, bwd = ((kernels.sparsemax_forward, kernels.sparsemax_backward) if op == "sparsemax"
                else (entmax.entmax15_forward, entmax.entmax15_backward))

    n = 1001 if ON_GPU else 101
    # The second round replays the first round's launches on new values (nothing is kept under
    # the interpreter, so one round there).
    for seed in range(2 if ON_GPU else 1):
        base = make("randn", 2 * ROWS + 2, n, seed=22 + seed)
        for x in [base[:, :-1], base[:, 1:], base[1:, :-1], base[:, ::2], base[:, :-1].t(),
                  base.reshape(2, ROWS + 1, n).permute(1, 0, 2)[::2]]:
            dim = x.dim() - 1
            y = fwd(x, dim)
            assert torch.equal(y, fwd(x, dim, out=poisoned(x)))
            g = make("rand", 1, y.numel(), seed=seed).reshape(y.shape)
            assert torch.equal(bwd(y, g, dim), bwd(y, g, dim, out=poisoned(y)))


def test_short_rows_share_a_program():
    x = make("randn", 3 * ROWS + 5, 16, seed=4)
    assert kernels.rows_launch(x, x.shape[0], 16, align=4).block_m > 1
    assert_close_to_oracle(forward(x).cpu(), x.cpu(), -1, rtol=1e-6)


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_every_dim_without_copy(dim):
    x = make("randn", 4, 5 * 7, seed=5).reshape(4, 5, 7)
    assert kernels.rows_view(x, dim % 3) is not None
    assert_close_to_oracle(forward(x, dim).cpu(), x.cpu(), dim, rtol=1e-6)


@pytest.mark.parametrize("chunk", [None, 128], ids=["in-registers", "split"])
def test_launchers_take_a_negative_dim(chunk):
    # Counted from the end, as torch does (a negative dim once read garbage strides).
    x = make("randn", ROWS, 300, seed=23)
    y = forward(x, 1, chunk=chunk)
    assert torch.equal(kernels.sparsemax_forward(x, -1, chunk=chunk), y)
    g = make("randn", ROWS, 300, seed=24)
    dx = backward(y, g, 1, chunk=chunk)
    assert torch.equal(kernels.sparsemax_backward(y, g, -1, chunk=chunk), dx)
    want = reference.sparsemax_backward(y.double(), g.double())
    assert torch.allclose(dx.double(), want, atol=1e-6)


def adjacent(rows: torch.Tensor, outer: int = 2) -> torch.Tensor:
    """rows (R x n) as an [outer, n, R / outer] tensor, contiguous: reduced over dim 1, its rows
    are adjacent in memory (an [N, C, H, W] input over C)."""
    return rows.reshape(outer, rows.shape[0] // outer, rows.shape[1]).transpose(1, 2).contiguous()


def assert_adjacent_launch(x: torch.Tensor, out: torch.Tensor, dim: int) -> None:
    outer, inner, x_strides = kernels.rows_view(x, dim)
    found = kernels.adjacent_rows_launch(x, outer * inner, x.shape[dim], inner,
                                         (x_strides, kernels.rows_view(out, dim)[2]))
    assert found is not None, "this layout should take the adjacent-rows launch"


@pytest.mark.parametrize("n", [10, 100, 1000])
@pytest.mark.parametrize("dist", DISTS)
def test_adjacent_rows(dist, n):
    # More rows an outer index than a program's, and not a multiple of them (`adjacent_launch`:
    # 128 at 10 entries, 8 at 100 and 1000).
    inner = {10: 130, 100: 37, 1000: 9}[n]
    x = adjacent(make(dist, 2 * inner, n, seed=n))
    assert_adjacent_launch(x, x, 1)
    assert_close_to_oracle(forward(x, 1).cpu(), x.cpu(), 1, rtol=1e-6)


@pytest.mark.parametrize("values", [4, 64])
def test_adjacent_rows_values_a_thread(values):
    """`adjacent_values` (a benchmark knob): rows over more threads, or fewer."""
    x = adjacent(make("rand", 2 * 37, 100, seed=values))
    assert_close_to_oracle(forward(x, 1, adjacent_values=values).cpu(), x.cpu(), 1, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_adjacent_rows_other_dtypes(dtype):
    x = adjacent(make("randn", 2 * 37, 100, dtype, seed=3))
    assert_adjacent_launch(x, x, 1)
    got = forward(x, 1).cpu()
    if dtype == torch.float64:
        assert_close_to_oracle(got, x.cpu(), 1, rtol=1e-12)
    else:
        want = oracle(x.float().cpu(), 1).to(dtype)
        ulp = torch.finfo(dtype).eps
        assert torch.allclose(got.float(), want.float(), rtol=ulp, atol=ulp * 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [10, 200, 1000])
def test_adjacent_rows_backward(n, dtype):
    """Rows adjacent in memory, in `launch_config`'s tiles (short ones) or `adjacent_launch`'s
    (ADJACENT_GRADIENT_ENTRIES: bf16 from 256 entries, fp32 from 512)."""
    inner = {10: 130, 200: 37, 1000: 9}[n]
    y = forward(adjacent(make("randn", 2 * inner, n, dtype, seed=n)), 1)
    g = adjacent(make("randn", 2 * inner, n, dtype, seed=n + 1))
    if 1 << (n - 1).bit_length() >= kernels.ADJACENT_GRADIENT_ENTRIES[y.element_size()]:
        assert_adjacent_launch(y, g, 1)
    dx = backward(y, g, 1)
    want = reference.sparsemax_backward(y.movedim(1, -1).double(), g.movedim(1, -1).double())
    ulp = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert torch.allclose(dx.movedim(1, -1).double(), want, rtol=ulp, atol=ulp)


def test_adjacent_rows_of_a_transpose():
    """A 2-D transpose's rows (stride 1 between rows), into an output laid out alike."""
    x = make("randn", 50, 37, seed=8).t()
    out = torch.full_like(x, POISON)
    assert_adjacent_launch(x, out, 1)
    y = kernels.sparsemax_forward(x, 1, out=out)
    assert not (y == POISON).any()
    assert_close_to_oracle(y.cpu(), x.cpu(), 1, rtol=1e-6)


@pytest.mark.parametrize("config", [{}, {"chunk": 64}], ids=["in-registers", "split"])
def test_strided_views(config):
    base = make("randn", 2 * ROWS, 3 * 100, seed=6).reshape(2 * ROWS, 3, 100)
    for view, dim in [
        (base.transpose(0, 2), 0),  # features strided, rows contiguous
        (base[::2, 1, :], 1),  # row stride 600, unit feature stride
        (base[:, :, ::3], 2),  # feature stride 3
        (base.permute(1, 0, 2)[:, ::2], 0),  # dims around dim that cannot merge: copied
    ]:
        assert_close_to_oracle(forward(view, dim, **config).cpu(), view.cpu(), dim, rtol=1e-6)


@pytest.mark.parametrize("config", [{}, {"programs_per_sm": 1}, {"chunk": 16},
                                    {"chunk": 16, "sparse_write": 1},
                                    {"chunk": 16, "programs_per_sm": 0},
                                    {"chunk": 16, "early_zeros": 8}],
                         ids=["in-registers", "prefetching", "split", "split-rereading",
                              "split-chunk-a-program", "split-early-zeros"])
def test_bad_rows_are_nan_and_leave_others_alone(config):
    x = make("randn", 6, 40, seed=7)
    x[0, 3] = torch.nan
    x[1, 5] = torch.inf
    x[2] = -torch.inf
    x[3, :30] = -torch.inf
    y = forward(x, **config)
    assert torch.isnan(y[:3]).all()
    assert not torch.isnan(y[3:]).any()
    assert (y[3, :30] == 0).all()
    assert_close_to_oracle(y[3:].cpu(), x[3:].cpu(), -1, rtol=1e-6)
    assert torch.equal(y[4:], forward(x[4:].clone(), **config))


@pytest.mark.parametrize("n", [16, 40])  # one thread a row; several threads a row
def test_bad_half_rows_in_a_short_tile(n):
    # Tiles of short 2-byte rows start from each row's largest two: a NaN, +inf or all -inf
    # row is NaN, and masked entries are 0, whatever that start makes of them.
    x = make("randn", 6, n, torch.bfloat16, seed=9)
    x[0, 3] = torch.nan
    x[1, 5] = torch.inf
    x[2] = -torch.inf
    x[3, :n - 1] = -torch.inf  # one finite entry: it takes all the mass
    x[4, ::2] = -torch.inf
    y = forward(x)
    assert torch.isnan(y[:3]).all()
    assert not torch.isnan(y[3:]).any()
    assert y[3, -1] == 1 and (y[3, :-1] == 0).all()
    assert (y[4, ::2] == 0).all()
    want = oracle(x[3:].float().cpu()).to(torch.bfloat16)
    ulp = torch.finfo(torch.bfloat16).eps
    assert torch.allclose(y[3:].cpu().float(), want.float(), rtol=ulp, atol=ulp * 1e-3)


def test_deterministic():
    x = make("rand", ROWS, 4096, seed=8)
    assert torch.equal(forward(x), forward(x))


@pytest.mark.parametrize("split", [False, True], ids=["in-registers", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n", [5, 1000])
def test_backward_matches_formula(dtype, n, split):
    x = make("rand", ROWS, n, dtype, seed=9)  # large supports: every chunk holds some
    y = forward(x)
    g = make("randn", ROWS, n, dtype, seed=10)
    dx = backward(y, g, 1, chunk=(2 if n == 5 else 64) if split else None)
    want = reference.sparsemax_backward(y.double(), g.double())
    tol = 1e-12 if dtype == torch.float64 else torch.finfo(dtype).eps * 4
    assert torch.allclose(dx.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_widest_rows(dtype):
    # Rows of 32768 entries, the widest held whole: 2-byte ones take GRADIENT_ROW_WARPS' 16
    # warps (the test checks the values; the warps are the launch's).
    x = make("randn", 2, 32768, dtype, seed=40)
    y = reference.sparsemax_sort(x.double()).to(dtype)
    g = make("randn", 2, 32768, dtype, seed=41)
    dx = backward(y, g, 1)
    want = reference.sparsemax_backward(y.double(), g.double())
    tol = torch.finfo(dtype).eps * 4
    assert torch.allclose(dx.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("chunk", [None, 64], ids=["in-registers", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_backward_ignores_grad_off_the_support(dtype, chunk):
    """g off the support takes no part: NaN and inf there leave dx what it is with g zeroed
    there (and finite). Split into chunks of 64, most of a randn row's chunks lie outside its
    support: they read no g, and write zeros without reading y again
    (`sparsemax_split_backward_sums_kernel`, `sparsemax_split_backward_kernel`)."""
    x = make("randn", ROWS, 300, dtype, seed=24)
    y = forward(x)
    g = make("randn", ROWS, 300, dtype, seed=25)
    bad_g = g.masked_fill(y == 0, float("nan"))
    bad_g[:, 1::2] = bad_g[:, 1::2].masked_fill(y[:, 1::2] == 0, float("inf"))
    dx = backward(y, bad_g, 1, chunk=chunk)
    assert bool(dx.isfinite().all())
    assert torch.equal(dx, kernels.sparsemax_backward(y, g.masked_fill(y == 0, 0.0), 1,
                                                      chunk=chunk))
    want = reference.sparsemax_backward(y.double(), g.double())
    tol = torch.finfo(dtype).eps * 4
    assert torch.allclose(dx.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [None, 8], ids=["in-registers", "split"])
def test_entries_at_tau_are_outside_the_support(dtype, chunk):
    x = torch.tensor(ROWS_AT_TAU, dtype=dtype, device=DEVICE)
    y = forward(x, chunk=chunk)
    assert torch.equal(y > 0, oracle(x) > 0)
    g = make("randn", *x.shape, dtype, seed=23)
    dx = backward(y, g, 1, chunk=chunk)
    want = support_gradient(x, g)
    atol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(dx.double(), want, rtol=0, atol=atol)


@pytest.mark.parametrize("chunk", [None, 4], ids=["in-registers", "split"])
def test_an_entry_just_above_tau_stays_in_the_support(chunk):
    x = torch.tensor([ROW_JUST_ABOVE_TAU] * 3, device=DEVICE)  # a tile of several rows
    y = forward(x, chunk=chunk)
    assert (y[:, 6] == 2.0**-24).all(), y
    assert torch.equal(y, forward(x[:1].clone(), chunk=chunk).expand(3, -1))


@pytest.mark.parametrize("n, chunk", [(100, None), (1000, None), (4096, None), (1000, 256)])
def test_a_tiny_row_among_others(n, chunk):
    """The row above, padded with entries outside its support, between randn rows of a tile
    (or split rows): its outputs are computed again in fp64, the other rows keep theirs."""
    x = make("randn", 5, n, seed=n)
    row = torch.full((n,), -3.0, device=DEVICE)
    row[:8] = torch.tensor(ROW_JUST_ABOVE_TAU, device=DEVICE)
    x[2] = row
    y = forward(x, chunk=chunk)
    assert y[2, 6] == 2.0**-24, y[2, :8]
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6)
    assert torch.equal(y[[0, 1, 3, 4]], forward(x[[0, 1, 3, 4]], chunk=chunk))


# Register caps that fit one more program a SM (NOTES, v65, v73): ptxas then spills, in bf16 in
# the tiny rows' fp64 code only (fp32 16384 at 168 spills on its hot path too: slower, the same
# bits). The caps take effect on the GPU; the interpreter ignores them.
@pytest.mark.parametrize("n, max_registers",
                         [(64, 80), (1000, 80), (2048, 128), (8192, 128), (16384, 168)] if ON_GPU
                         else [(300, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dist", ["randn", "rand", "tiny_rows"])
def test_register_capped_launch_is_bit_identical(dist, dtype, n, max_registers):
    """Every third row of "tiny_rows" is 1, 2^-23 and -3s: its outputs 1 - 2^-24 and 2^-24,
    exact in either dtype, the second within the fp32 threshold's rounding of tau, so that
    only the fp64 refinement (where a capped kernel's spills mostly are) keeps it. Every output
    as without the cap."""
    x = make("rand" if dist == "rand" else "randn", ROWS, n, dtype, seed=n)
    if dist == "tiny_rows":
        x[::3] = -3.0
        x[::3, 0] = 1.0
        x[::3, 1] = 2.0**-23
    y = forward(x, max_registers=max_registers)
    assert torch.equal(y, forward(x, max_registers=0))  # 0: uncapped (the default caps some)
    if dist == "tiny_rows":
        assert (y[::3, 1] == 2.0**-24).all(), y[::3, :2]
    if dtype == torch.float32:
        assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6)


# Few long rows' pass 1 (16384-entry chunks over 16 warps) takes 105 registers, one program a
# SM; capped at 64, two fit and 256 chunks run in one wave, with spills (NOTES, session 32).
@pytest.mark.parametrize("rows, n, chunk", [(2, 1 << 20, None), (8, 1 << 18, None)] if ON_GPU
                         else [(2, 3000, 1024)])
@pytest.mark.parametrize("dist", ["randn", "rand"])
def test_register_capped_split_pass_is_bit_identical(dist, rows, n, chunk):
    x = make(dist, rows, n, seed=rows)
    y = forward(x, chunk=chunk, max_registers=64)
    assert torch.equal(y, forward(x, chunk=chunk))
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6)


def test_register_cap_reaches_the_launch(monkeypatch, record_launches):
    """max_registers (default ROW_REGISTER_CAPS') goes to Triton as maxnreg for rows held by
    `rows_launch`'s programs; rows adjacent in memory take `adjacent_launch`'s, uncapped.
    Nothing runs: the launches are recorded (`out=` keeps none to replay)."""
    launched = record_launches(kernels.FORWARD_LAUNCHES)
    x = torch.randn(4, 64, device=DEVICE)
    for rows, want in [(x, 96), (x.t(), None)]:
        kernels.sparsemax_forward(rows, 1, out=torch.empty_like(rows), max_registers=96)
        assert launched[-1]["maxnreg"] == want, launched[-1]
    kernels.sparsemax_forward(x, 1, out=torch.empty_like(x))
    assert launched[-1]["maxnreg"] is None
    # By default, ROW_REGISTER_CAPS' caps: 2-byte rows of 64-1024, 8192 and 16384 entries,
    # the first from 64 programs a SM (of one multiprocessor here: 16 rows of 64 entries a
    # program, 1 of 1000); 0 uncaps.
    monkeypatch.setattr(kernels, "_multiprocessors", lambda device: 1)
    for dtype, rows, n, cap, want in [(torch.bfloat16, 2, 8192, None, 128),
                                      (torch.bfloat16, 2, 10000, None, 168),
                                      (torch.bfloat16, 2, 8192, 0, None),
                                      (torch.float32, 2, 8192, None, None),
                                      (torch.bfloat16, 2, 4096, None, None),
                                      (torch.bfloat16, 1024, 64, None, 80),
                                      (torch.bfloat16, 1008, 64, None, None),
                                      (torch.bfloat16, 2, 64, None, None),
                                      (torch.bfloat16, 64, 1000, None, 80),
                                      (torch.bfloat16, 63, 1000, None, None),
                                      (torch.bfloat16, 64, 1000, 0, None),
                                      (torch.float32, 64, 1000, None, None),
                                      (torch.bfloat16, 4096, 32, None, None),
                                      (torch.bfloat16, 64, 2048, None, None)]:
        x = torch.randn(rows, n, device=DEVICE).to(dtype)
        kernels.sparsemax_forward(x, 1, out=torch.empty_like(x), max_registers=cap)
        assert launched[-1]["maxnreg"] == want, (dtype, rows, n, cap, launched[-1])


def test_register_cap_reaches_split_pass_one(monkeypatch):
    """Split rows: max_registers caps pass 1's launch (`SplitRows`), the only pass that holds
    a chunk; the kernel is recorded, then run."""
    launched = []
    kernel = kernels.split_bounds_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **options):
                launched.append(options.get("maxnreg"))
                return kernel[grid](*args, **options)
            return launch

    monkeypatch.setattr(kernels, "split_bounds_kernel", Recording())
    x = make("randn", 2, 600, seed=3)
    for cap in (64, None):
        forward(x, chunk=256, max_registers=cap)
        assert launched[-1] == cap, launched


@pytest.mark.parametrize("n", [1024, 2048])
def test_two_support_entries_in_one_group(n):
    """A row whose support is two entries of one group (columns w and w + k * n / GROUP): the
    group maxima's tau leaves the second out, so the full-row steps must run; the randn rows
    around it (2048: one a tile) take the group maxima's tau, confirmed by a count."""
    x = make("randn", 4, n, seed=21)
    x[1] = x[1] * 0.01 - 5.0
    x[1, 5] = 1.0
    x[1, 5 + 3 * n // 8] = 0.875
    y = forward(x)
    assert y[1, 5] == 0.5625 and y[1, 5 + 3 * n // 8] == 0.4375, y[1, [5, 5 + 3 * n // 8]]
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6)


@triton.jit
def _merge_kernel(A, B, OUT, N: tl.constexpr):
    rows = tl.arange(0, N) * 2
    first, second = kernels._top_two(tl.load(A + rows), tl.load(A + rows + 1),
                                     tl.load(B + rows), tl.load(B + rows + 1))
    tl.store(OUT + rows, first)
    tl.store(OUT + rows + 1, second)


def test_top_two_merges_any_two_lists():
    """The reduction's step: the largest two of two descending pairs, ties and -inf included
    (on a GPU the reduction merges partial pairs; the interpreter only appends one value)."""
    n = 256
    g = torch.Generator().manual_seed(4)
    values = torch.randint(0, 4, (n, 4), generator=g).float()
    values[torch.rand(n, 4, generator=g) < 0.2] = -torch.inf
    a, b = (half.sort(dim=1, descending=True).values.contiguous() for half in values.split(2, 1))
    out = torch.full((n, 2), POISON, device=DEVICE)
    _merge_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), out, N=n)
    assert torch.equal(out.cpu(), values.sort(dim=1, descending=True).values[:, :2])


@triton.jit
def _start_kernel(GROUP_MAX, OUT, WIDTH: tl.constexpr, ENTMAX15: tl.constexpr):
    group_max = tl.load(GROUP_MAX + tl.arange(0, WIDTH))[None, :]
    if ENTMAX15:
        row_max, start = kernels._row_max_and_start(group_max, True,
                                                    entmax_kernels._entmax_top_two_start)
    else:
        row_max, start = kernels._row_max_and_start(group_max, True,
                                                    kernels._sparsemax_top_two_start)
    tl.store(OUT + tl.arange(0, 1), row_max)
    tl.store(OUT + 1 + tl.arange(0, 1), start)


def _tau(d: torch.Tensor, op: str) -> float:
    """The exact threshold of a set of d = x - max <= 0 (finite or -inf) in the op's coordinates:
    sparsemax's is the largest (sum of its top k - 1) / k; entmax-1.5's, in z = d / 2, the root
    of sum(max(z - t, 0)^2) = 1, by bisection in fp64."""
    d = d.double()[d > -torch.inf].sort(descending=True).values
    if op == "sparsemax":
        return ((d.cumsum(0) - 1) / torch.arange(1, len(d) + 1, dtype=torch.float64)).max().item()
    z, low, high = d / 2, -1.0, 0.0
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if ((z - mid).clamp(min=0) ** 2).sum() > 1 else (low, mid)
    return low


@pytest.mark.parametrize("op", ["sparsemax", "entmax15"])
@pytest.mark.parametrize("dist", ["randn", "rand", "ties", "near", "masked", "huge"])
def test_group_maxima_start_is_the_top_two_tau(op, dist):
    """The group maxima's Newton steps start just below the exact tau of the row's largest two,
    which is a lower bound on their tau."""
    width = 64
    g = torch.Generator().manual_seed(len(dist))
    for trial in range(20):
        x = torch.randn(width, generator=g, dtype=torch.float64)
        if dist == "rand":
            x = torch.rand(width, generator=g, dtype=torch.float64)
        elif dist == "ties":
            x = torch.randint(0, 3, (width,), generator=g).double() / 4
        elif dist == "near":  # two within 1e-3 of each other, anywhere in the row
            x[torch.randperm(width, generator=g)[:2]] = (
                5.0 + torch.rand(2, generator=g, dtype=torch.float64) * 1e-3)
        elif dist == "masked":  # one to five finite
            x[torch.randperm(width, generator=g)[:width - 1 - trial % 5]] = -torch.inf
        elif dist == "huge":
            x = x * 1e3
        x = x.float()
        out = torch.full((2,), POISON, device=DEVICE)
        _start_kernel[(1,)](x.to(DEVICE), out, WIDTH=width, ENTMAX15=op == "entmax15")
        row_max, start = out.cpu().double().tolist()
        assert row_max == x.max().item()
        d = x.double() - row_max
        top_two = _tau(d.sort(descending=True).values[:2], op)
        assert start <= _tau(d, op), (trial, start, _tau(d, op))
        assert start >= top_two - 2.0**-19, (trial, start, top_two)


def test_backward_strided_grad():
    x = make("randn", 3 * 4, 50, seed=11).reshape(3, 4, 50).transpose(0, 2)  # dim 0
    y = forward(x, 0)
    g = make("randn", 50, 4 * 3, seed=12).reshape(50, 4, 3)
    dx = backward(y, g, 0)
    want = reference.sparsemax_backward(y.movedim(0, -1).double(), g.movedim(0, -1).double())
    assert torch.allclose(dx.movedim(0, -1).double(), want, atol=1e-6)


@pytest.mark.skipif(not ON_GPU, reason="the public op runs the kernels on CUDA tensors only")
def test_public_op_uses_kernels_and_autograd():
    import flashmax

    x = make("randn", 512, 4096, seed=13).requires_grad_()
    y = flashmax.sparsemax(x)
    assert torch.equal(y, forward(x.detach()))
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    assert torch.allclose(dx, kernels.sparsemax_backward(y.detach(), g, 1))


@pytest.mark.skipif(not ON_GPU, reason="the eager fast path serves CUDA tensors only")
def test_eager_path_matches_custom_op():
    import flashmax

    x = make("rand", 64, 1000, seed=16).requires_grad_()
    g = torch.randn_like(x)
    y_fast = flashmax.sparsemax(x, 1)
    y_op = torch.ops.flashmax.sparsemax(x, 1)
    assert torch.equal(y_fast, y_op) and type(y_fast.grad_fn).__name__ == "_EagerSparsemaxBackward"
    (dx_fast,) = torch.autograd.grad(y_fast, x, g)
    (dx_op,) = torch.autograd.grad(y_op, x, g)
    assert torch.equal(dx_fast, dx_op)
    xd = make("randn", 3, 20, torch.float64, seed=17).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: flashmax.sparsemax(t, 1), (xd,))
    # Without a graph to record (no grad wanted, or grad mode off) the launcher runs alone.
    for y_bare in (flashmax.sparsemax(x.detach(), 1), torch.no_grad()(flashmax.sparsemax)(x, 1)):
        assert y_bare.grad_fn is None and not y_bare.requires_grad
        assert torch.equal(y_bare, y_op)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture():
    import flashmax

    x = make("rand", 256, 8192, seed=14)
    flashmax.sparsemax(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = flashmax.sparsemax(x)
    x.copy_(make("randn", 256, 8192, seed=15))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, rtol=1e-6)


@pytest.mark.parametrize("dtype, index, prefetch", [("fp32", "int32", 0), ("bf16", "int16", 0),
                                                    ("fp64", "int64", 0), ("fp32", "int32", 1)])
def test_scatter_assembly_builds_for_sm90(dtype, index, prefetch):
    """Split pass 1's candidate stores are inline PTX on the GPU only (the interpreter runs
    tl.store): build that kernel for an H200 here, through ptxas, for each output width (and
    once walking chunks with prefetch), so that a fault in the assembly shows on a machine
    without a GPU."""
    import subprocess
    import sys
    from pathlib import Path

    ptxas = Path(kernels.triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"triton's wheel has no ptxas here ({ptxas})")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")])
    chunk = 4096 if dtype == "fp64" else 8192
    ptx, constraints = kernels.store_ptx(int(index[3:]) // 8)
    built = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "inspect_kernel.py"),
         "split_bounds_kernel", "--dtype", dtype, "--warps", "4", "--const",
         f"CHUNK={chunk}", "GROUP=8", f"INDEX={index}", "WIDE=0", f"SCATTER_PTX={ptx}",
         f"SCATTER_CONSTRAINTS={constraints}", f"PREFETCH={prefetch}",
         f"BOUND_GROUPS={kernels.SPLIT_BOUND_GROUPS[True]}", "BOUND=_sparsemax_chunk_bound",
         "TOP_TWO_START=_sparsemax_top_two_start",
         f"EARLY_ZEROS={kernels.SPLIT_EARLY_ZEROS[True]}",
         f"SHARE_STEPS={kernels.SPLIT_SHARE_STEPS[False]}", "SECOND=1"],
        capture_output=True, text=True, env=env, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "registers" in built.stdout, built.stdout
