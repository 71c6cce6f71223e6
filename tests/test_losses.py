"""The sparsemax and entmax-1.5 losses: values and gradients against an fp64 formula built on the
sort-based oracles (and the entmax package when installed), ignore_index, reductions, errors,
custom ops, and the fused kernel under the interpreter (or compiled with
FLASHMAX_TEST_DEVICE=cuda)."""

import math
import os

import pytest
import torch

import flashmax
from flashmax import Entmax15Loss, SparsemaxLoss, entmax15_loss, losses, sparsemax_loss
from oracle import entmax15_oracle, oracle

DEVICE = os.environ.get("FLASHMAX_TEST_DEVICE", "cpu")
LOSSES = {"sparsemax": (sparsemax_loss, SparsemaxLoss, oracle),
          "entmax15": (entmax15_loss, Entmax15Loss, entmax15_oracle)}
IGNORE = -100


def expected(name: str, x: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE):
    """(loss per row, gradient) in fp64 from the definition: <p - onehot, x> + omega(p)."""
    x = x.double().cpu()
    p = LOSSES[name][2](x, -1)
    if name == "sparsemax":
        omega = (1 - (p * p).sum(-1)) / 2
    else:
        omega = (1 - (p ** 1.5).sum(-1)) / 0.75
    ignored = target.cpu() == ignore_index
    onehot = torch.nn.functional.one_hot(target.cpu().masked_fill(ignored, 0), x.shape[-1])
    diff = torch.where(ignored.unsqueeze(-1), 0.0, p - onehot)
    # Entries outside the support take no part (0 * -inf would be NaN); a target at -inf
    # gives +inf, as documented.
    loss = (diff * torch.where(diff == 0, 0, x)).sum(-1) + torch.where(ignored, 0, omega)
    return loss, diff


def scores(rows: int, n: int, dtype=torch.float32, seed: int = 0, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)
    target = torch.randint(n, (rows,), generator=g).to(DEVICE)
    return x, target


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("n", [1, 2, 17, 300])
def test_value_and_gradient_match_formula(name, n):
    x, target = scores(9, n, torch.float64, seed=n)
    target[3] = IGNORE
    x.requires_grad_()
    loss = LOSSES[name][0](x, target)
    want_loss, want_grad = expected(name, x.detach(), target)
    torch.testing.assert_close(loss.cpu(), want_loss, rtol=1e-10, atol=1e-12)
    assert loss[3].item() == 0.0
    w = torch.randn(9, dtype=torch.float64, device=DEVICE)
    (dx,) = torch.autograd.grad(loss, x, w)
    torch.testing.assert_close(dx.cpu(), want_grad * w.cpu().unsqueeze(-1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", LOSSES)
def test_fp32_and_offsets(name):
    x, target = scores(12, 50, seed=1)
    for offset in (0.0, 1e4):
        shifted = x + offset
        want, _ = expected(name, shifted, target)
        got = LOSSES[name][0](shifted, target)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(name, dtype):
    x, target = scores(8, 40, dtype, seed=2)
    want, _ = expected(name, x.float(), target)
    got = LOSSES[name][0](x, target)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().double(), want, rtol=2 * torch.finfo(dtype).eps,
                               atol=torch.finfo(dtype).eps)


@pytest.mark.parametrize("name", LOSSES)
def test_matches_entmax_package(name):
    entmax = pytest.importorskip("entmax")
    theirs_fn = {"sparsemax": entmax.sparsemax_loss, "entmax15": entmax.entmax15_loss}[name]
    theirs_module = {"sparsemax": entmax.SparsemaxLoss, "entmax15": entmax.Entmax15Loss}[name]
    x, target = scores(10, 30, torch.float64, seed=3)
    x = x.cpu().requires_grad_()
    target = target.cpu()
    ours, theirs = LOSSES[name][0](x, target), theirs_fn(x, target)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    w = torch.randn(10, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(ours, x, w)[0], torch.autograd.grad(theirs, x, w)[0],
                               rtol=0, atol=1e-12)
    target[[2, 5]] = 4  # entmax masks ignore_index only when it is >= 0
    for reduction in ("none", "sum", "elementwise_mean"):
        ours = LOSSES[name][1](ignore_index=4, reduction=reduction)(x, target)
        theirs = theirs_module(ignore_index=4, reduction=reduction)(x, target)
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", LOSSES)
def test_reductions_and_ignore_index(name):
    fn, module, _ = LOSSES[name]
    x, target = scores(8, 20, torch.float64, seed=4)
    target[[1, 6]] = 7
    per_row, _ = expected(name, x, target, ignore_index=7)
    kept = int((target != 7).sum())
    got = {r: fn(x, target, ignore_index=7, reduction=r) for r in ("none", "sum", "mean", "elementwise_mean")}
    torch.testing.assert_close(got["none"].cpu(), per_row, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["sum"].cpu(), per_row.sum(), rtol=1e-12, atol=1e-12)
    for mean in ("mean", "elementwise_mean"):
        torch.testing.assert_close(got[mean].cpu(), per_row.sum() / kept, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(module(ignore_index=7)(x, target), got["mean"], rtol=0, atol=0)
    assert "elementwise_mean" in repr(module())


@pytest.mark.parametrize("name", LOSSES)
def test_leading_dims_and_noncontiguous(name):
    x, target = scores(12, 9, torch.float64, seed=5)
    x3 = x.reshape(3, 4, 9).transpose(0, 1)  # non-contiguous [4, 3, 9]
    t3 = target.reshape(3, 4).t()
    got = LOSSES[name][0](x3, t3)
    want, _ = expected(name, x3.reshape(12, 9), t3.reshape(12))
    assert got.shape == (4, 3)
    torch.testing.assert_close(got.reshape(12).cpu(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", LOSSES)
def test_bad_rows_masks_and_empty(name):
    fn = LOSSES[name][0]
    x, target = scores(5, 6, seed=6)
    x[0, 2] = math.nan
    x[1, :] = -math.inf
    x[2, [0, 1]] = -math.inf
    target[2] = 3
    loss = fn(x, target)
    assert bool(torch.isnan(loss[:2]).all()) and bool(torch.isfinite(loss[2:]).all())
    want, _ = expected(name, x[2:], target[2:])
    torch.testing.assert_close(loss[2:].cpu().double(), want, rtol=1e-6, atol=1e-6)
    empty = fn(torch.empty(0, 4, device=DEVICE), torch.empty(0, dtype=torch.long, device=DEVICE))
    assert empty.shape == (0,)


@pytest.mark.parametrize("name", LOSSES)
def test_errors(name):
    fn = LOSSES[name][0]
    x, target = scores(4, 5, seed=7)
    with pytest.raises(ValueError, match="reduction"):
        fn(x, target, reduction="avg")
    with pytest.raises(ValueError, match="reduction"):
        LOSSES[name][1](reduction="avg")
    with pytest.raises(ValueError, match="shape"):
        fn(x, target[:3])
    with pytest.raises(TypeError, match="target"):
        fn(x, target.float())
    with pytest.raises(TypeError, match="dtype"):
        fn(x.long(), target)
    with pytest.raises(ValueError, match="0-d"):
        fn(x[0, 0], target[0])


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("n", [5, 3000])  # the fused kernel on a GPU, and the torch path
def test_targets_out_of_range(name, n):
    """On the CPU a ValueError. Elsewhere a check would take a host sync (no CUDA graphs): that
    row's loss and gradient are NaN, the other rows as they would be."""
    fn = LOSSES[name][0]
    x, target = scores(4, n, seed=7)
    want, want_grad = expected(name, x, target)
    for bad in (n, -1, 100 * n):
        wrong = target.clone()
        wrong[2] = bad
        if DEVICE == "cpu":
            with pytest.raises(ValueError, match="out of range"):
                fn(x, wrong)
            continue
        xg = x.clone().requires_grad_()
        loss = fn(xg, wrong)
        (dx,) = torch.autograd.grad(loss, xg, torch.ones_like(loss))
        assert bool(torch.isnan(loss[2])) and bool(torch.isnan(dx[2]).all())
        keep = [0, 1, 3]
        torch.testing.assert_close(loss[keep].cpu().double(), want[keep], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dx[keep].cpu().double(), want_grad[keep], rtol=0, atol=1e-6)


@pytest.mark.parametrize("use_entmax15", [False, True])
def test_no_classes_give_zero_for_ignored_rows_and_nan_for_others(use_entmax15):
    # Every target is then out of range but ignore_index. Such rows take the torch path on
    # every device: the fused kernel does not take them.
    from flashmax.kernels import entmax as kernels

    x = torch.empty(3, 0, device=DEVICE)
    target = torch.tensor([IGNORE, 0, IGNORE], device=DEVICE)
    loss = losses._loss_rows(x, target, IGNORE, use_entmax15)
    assert loss[0].item() == 0.0 and loss[2].item() == 0.0 and bool(torch.isnan(loss[1]))
    assert not kernels.loss_fits(0, x.dtype)
    with pytest.raises(ValueError, match="0 classes"):
        kernels.loss(x, target, IGNORE, use_entmax15)
    fn = flashmax.entmax15_loss if use_entmax15 else flashmax.sparsemax_loss
    ignored = torch.full((3,), IGNORE, device=DEVICE)
    assert torch.equal(fn(x, ignored, ignore_index=IGNORE, reduction="none"),
                       torch.zeros(3, device=DEVICE))


@pytest.mark.parametrize("use_entmax15", [False, True])
def test_torch_path_makes_out_of_range_rows_nan(use_entmax15):
    # The rows CUDA's losses compute with torch ops (rows past the fused kernel's registers),
    # run here on the CPU, where the public functions raise before reaching them.
    name = "entmax15" if use_entmax15 else "sparsemax"
    x, target = scores(4, 6, torch.float64, seed=3)
    want, want_grad = expected(name, x, target)
    wrong = target.clone()
    wrong[1] = 6
    loss = losses._loss_rows(x, wrong, IGNORE, use_entmax15)
    dx = losses._gradient_rows(x, wrong, torch.ones(4, dtype=x.dtype, device=x.device), IGNORE,
                               use_entmax15)
    assert bool(torch.isnan(loss[1])) and bool(torch.isnan(dx[1]).all())
    keep = [0, 2, 3]
    torch.testing.assert_close(loss[keep].cpu(), want[keep], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dx[keep].cpu(), want_grad[keep], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", LOSSES)
def test_gradcheck_gradgradcheck_opcheck_compile(name):
    fn = LOSSES[name][0]
    x, target = scores(4, 6, torch.float64, seed=8)
    target[1] = IGNORE
    x.requires_grad_()
    assert torch.autograd.gradcheck(lambda t: fn(t, target), (x,), eps=1e-6, atol=1e-8)
    assert torch.autograd.gradgradcheck(lambda t: fn(t, target), (x,), eps=1e-6, atol=1e-8)
    use_entmax15 = name == "entmax15"
    torch.library.opcheck(torch.ops.flashmax.sparse_loss.default, (x, target, IGNORE, use_entmax15))
    grad = torch.randn(4, dtype=torch.float64, device=DEVICE)
    torch.library.opcheck(torch.ops.flashmax.sparse_loss_backward.default,
                          (x.detach(), target, grad, IGNORE, use_entmax15))
    compiled = torch.compile(lambda t: fn(t, target, reduction="mean"), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), fn(x, target, reduction="mean"), rtol=0, atol=0)


def test_exported_names_are_entmax_compatible():
    for name in ("sparsemax", "entmax15", "Entmax15", "sparsemax_loss", "entmax15_loss",
                 "SparsemaxLoss", "Entmax15Loss"):
        assert hasattr(flashmax, name), name
    x, target = scores(3, 7, seed=9)
    torch.testing.assert_close(flashmax.entmax15_loss(x, target, k=5), flashmax.entmax15_loss(x, target))


# ----------------------------------------------------------------------------------------------
# The fused kernel
# ----------------------------------------------------------------------------------------------

POISON = 12345.0


@pytest.mark.parametrize("name", LOSSES)
# fp32 rows: one thread each (1, 5, 16), eight threads each (200), one a program (300), one a
# program in groups spanning the layout (4096, sparsemax's: `WIDE_GROUPS_FROM`)
@pytest.mark.parametrize("n", [1, 5, 16, 200, 300, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_kernel(name, n, dtype):
    pytest.importorskip("triton")
    from flashmax.kernels import entmax as kernels

    use_entmax15 = name == "entmax15"
    x, target = scores(7, n, dtype, seed=n)
    x[2, : n // 2] = -math.inf
    target[4] = IGNORE
    x[5, 0] = math.nan
    target[5] = 0
    target[3] = n  # out of range: NaN
    out = torch.full((7,), POISON, dtype=dtype, device=DEVICE)
    loss = kernels.loss(x, target, IGNORE, use_entmax15, out=out)
    assert loss is out and not bool((loss == POISON).any())
    want, want_grad = expected(name, x.float() if dtype != torch.float64 else x,
                               target.clamp(max=n - 1))  # row 3's is not compared
    tol = {torch.float64: 1e-12, torch.float32: 2e-6}.get(dtype, 2 * torch.finfo(dtype).eps)
    assert bool(torch.isnan(loss[5])) and bool(torch.isnan(loss[3])) and loss[4].item() == 0.0
    keep = [0, 1, 2, 4, 6]
    torch.testing.assert_close(loss.cpu().double()[keep], want[keep], rtol=tol, atol=tol)
    grad_loss = torch.randn(7, dtype=torch.float64).to(dtype).to(DEVICE)
    out = torch.full(x.shape, POISON, dtype=dtype, device=DEVICE)
    dx = kernels.loss(x, target, IGNORE, use_entmax15, grad_loss=grad_loss, out=out)
    assert dx is out and not bool((dx == POISON).any())
    assert bool(torch.isnan(dx[5]).all()) and bool(torch.isnan(dx[3]).all())
    want_dx = want_grad * grad_loss.cpu().double().unsqueeze(-1)
    torch.testing.assert_close(dx.cpu().double()[keep], want_dx[keep], rtol=0, atol=2 * tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="the public losses run kernels on CUDA tensors only")
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("n", [1000, 40000])  # the fused kernel, and rows past its registers
def test_public_loss_on_gpu(name, n):
    x, target = scores(64, n, seed=n)
    target[7] = IGNORE
    x.requires_grad_()
    loss = LOSSES[name][0](x, target, reduction="sum")
    want_loss, want_grad = expected(name, x.detach(), target)
    torch.testing.assert_close(loss.cpu().double(), want_loss.sum(), rtol=1e-6, atol=1e-5)
    (dx,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(dx.cpu().double(), want_grad, rtol=0, atol=1e-6)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("name", LOSSES)
def test_loss_and_gradient_capture_in_a_cuda_graph(name):
    # No host sync on a GPU (out-of-range targets give NaN rows instead of a check).
    fn = LOSSES[name][0]
    x, target = scores(64, 1000, seed=21)
    x.requires_grad_()
    torch.autograd.grad(fn(x, target, reduction="sum"), x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = fn(x, target, reduction="sum")
        (dx,) = torch.autograd.grad(loss, x)
    fresh, fresh_target = scores(64, 1000, seed=22)
    with torch.no_grad():
        x.copy_(fresh)
    target.copy_(fresh_target)
    graph.replay()
    torch.cuda.synchronize()
    want_loss, want_grad = expected(name, fresh, fresh_target)
    torch.testing.assert_close(loss.cpu().double(), want_loss.sum(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(dx.cpu().double(), want_grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_vmap_over_batches_of_rows(name):
    """vmap of a loss over a batch of [rows, classes] scores: the same losses and gradients as
    the loss of all the rows at once."""
    loss = LOSSES[name][0]
    x, target = scores(4 * 6, 10, seed=70)
    x = x.reshape(4, 6, 10).requires_grad_()
    target = target.reshape(4, 6)
    target[1, 2] = IGNORE
    got = torch.func.vmap(lambda u, t: loss(u, t, ignore_index=IGNORE))(x, target)
    want = loss(x, target, ignore_index=IGNORE)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    (dx,) = torch.autograd.grad(got.sum(), x)
    (dx_want,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(dx, dx_want, rtol=1e-6, atol=1e-7)
