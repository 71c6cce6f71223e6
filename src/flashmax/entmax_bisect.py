"""α-entmax by root finding as PyTorch custom ops: validation, dispatch, autograd, public API.

Names and signatures follow the entmax package (`entmax_bisect`, `EntmaxBisect`), so that
`import flashmax as entmax` works for them. CUDA tensors run the Triton kernels in
`flashmax.kernels.entmax_bisect`; every other tensor runs `flashmax.reference_bisect` in
float64. Both use a bisection-safeguarded Newton iteration on τ (see `reference_bisect`), so
`n_iter` bounds the number of steps, each a pass over the row (the CPU path first spends up to
as many on the row's group maxima, 1/8 of it); rows stop early once converged.

α travels as a float64 tensor of x's shape with size 1 along dim (an expanded view when it is
one number), one α per slice. The backward op gives the entmax package's gradients w.r.t. x
and α; it is not differentiable itself (no double backward).
"""

import math

import torch
from torch import nn

from . import reference_bisect as reference
from .sparsemax import check_input, launchable, register_rowwise_vmap, uses_kernels

from .kernels import load as load_kernels

kernels = load_kernels("entmax_bisect")

NAME = "entmax_bisect"


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t's slices along dim as the rows of a 2-D float64 tensor."""
    return t.movedim(dim, -1).reshape(-1, t.shape[dim]).double()


def _unrows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    moved = like.movedim(dim, -1).shape
    return rows.reshape(moved).to(like.dtype).movedim(-1, dim).contiguous()


@torch.library.custom_op("flashmax::entmax_bisect", mutates_args=())
def _entmax_bisect_op(x: torch.Tensor, alpha: torch.Tensor, dim: int, n_iter: int,
                      ensure_sum_one: bool) -> torch.Tensor:
    if uses_kernels(x):
        return kernels.entmax_bisect_forward(x, alpha, dim, n_iter, ensure_sum_one)
    if not x.numel():
        return x.new_empty(x.shape)
    y_rows = reference.entmax_bisect_forward(_rows(x, dim), _rows(alpha, dim), n_iter,
                                             ensure_sum_one)
    return _unrows(y_rows, x, dim)


@_entmax_bisect_op.register_fake
def _(x, alpha, dim, n_iter, ensure_sum_one):
    return x.new_empty(x.shape)


@torch.library.custom_op("flashmax::entmax_bisect_backward", mutates_args=())
def _entmax_bisect_backward_op(y: torch.Tensor, grad: torch.Tensor, alpha: torch.Tensor,
                               dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if uses_kernels(y):
        return kernels.entmax_bisect_backward(y, grad, alpha, dim)
    if not y.numel():
        return y.new_empty(y.shape), alpha.new_zeros(alpha.shape)
    dx_rows, d_alpha_rows = reference.entmax_bisect_backward(
        _rows(y, dim), _rows(grad, dim), _rows(alpha, dim))
    return _unrows(dx_rows, y, dim), _unrows(d_alpha_rows, alpha, dim)


@_entmax_bisect_backward_op.register_fake
def _(y, grad, alpha, dim):
    return y.new_empty(y.shape), alpha.new_empty(alpha.shape)


def _setup_context(ctx, inputs, output):
    _, alpha, ctx.dim, _, _ = inputs
    ctx.save_for_backward(output, alpha)


def _backward(ctx, grad):
    y, alpha = ctx.saved_tensors
    dx, d_alpha = _entmax_bisect_backward_op(y, grad, alpha, ctx.dim)
    return dx, d_alpha, None, None, None


_entmax_bisect_op.register_autograd(_backward, setup_context=_setup_context)
register_rowwise_vmap(_entmax_bisect_op, 2)
register_rowwise_vmap(_entmax_bisect_backward_op, 3)


class _EagerEntmaxBisect(torch.autograd.Function):
    """Eager CUDA calls skip the custom-op dispatcher's host time; the same kernels."""

    @staticmethod
    def forward(ctx, x, alpha, dim, n_iter, ensure_sum_one):
        y = kernels.entmax_bisect_forward(x, alpha, dim, n_iter, ensure_sum_one)
        ctx.save_for_backward(y, alpha)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx, grad):
        y, alpha = ctx.saved_tensors
        if not launchable(grad):  # batched gradients (vmap): the op's dispatch serves them
            dx, d_alpha = _entmax_bisect_backward_op(y, grad, alpha, ctx.dim)
        else:
            dx, d_alpha = kernels.entmax_bisect_backward(y, grad, alpha, ctx.dim)
        return dx, d_alpha, None, None, None


def _check_n_iter(n_iter) -> None:
    if isinstance(n_iter, bool) or not isinstance(n_iter, int):
        raise TypeError(f"{NAME}: n_iter must be an int, got {type(n_iter).__name__}")
    if n_iter < 1:
        raise ValueError(f"{NAME}: n_iter must be at least 1, got {n_iter}")


def _alpha_per_slice(alpha, x: torch.Tensor, dim: int) -> torch.Tensor:
    """alpha as a float64 tensor of x's shape with size 1 along dim; ValueError where α <= 1.

    A tensor α is checked on the host, except while compiling, capturing a CUDA graph (no
    synchronisation there), under vmap or for a tensor subclass such as FakeTensor (no
    data-dependent branch there, `launchable`): slices whose α is not in (1, inf) then come
    out NaN.
    """
    shape = list(x.shape)
    shape[dim] = 1
    if not isinstance(alpha, torch.Tensor):
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise TypeError(f"{NAME}: alpha must be a float or a tensor, got {type(alpha).__name__}")
        if not (1 < alpha < math.inf):
            raise ValueError(f"{NAME}: alpha must be > 1 and finite, got {alpha}")
        # A fill, not a host-to-device copy: capturable in a CUDA graph.
        return x.new_full((), float(alpha), dtype=torch.float64).expand(shape)
    if alpha.is_complex() or alpha.dtype == torch.bool:
        raise TypeError(f"{NAME}: alpha must be a real tensor, got dtype {alpha.dtype}")
    try:
        broadcast = torch.broadcast_shapes(alpha.shape, shape)
    except RuntimeError:  # shapes that do not broadcast at all
        broadcast = None
    if broadcast != tuple(shape):
        raise ValueError(f"{NAME}: alpha of shape {tuple(alpha.shape)} does not broadcast to "
                         f"{tuple(shape)} (x's shape with size 1 along dim {dim})")
    alpha = alpha.to(device=x.device, dtype=torch.float64).expand(shape)
    if launchable(alpha) and not (alpha.is_cuda and torch.cuda.is_current_stream_capturing()):
        valid = (alpha > 1) & torch.isfinite(alpha)
        if not bool(valid.all()):
            raise ValueError(f"{NAME}: every alpha must be > 1 and finite, got "
                             f"{alpha.detach()[~valid].flatten()[0].item()}")
    return alpha


def entmax_bisect(X: torch.Tensor, alpha=1.5, dim: int = -1, n_iter: int = 50,
                  ensure_sum_one: bool = True) -> torch.Tensor:
    """α-entmax of X along dim: p = [(α−1)x − τ]_+^(1/(α−1)), τ such that each slice sums to 1.

    Same signature as `entmax.entmax_bisect`. alpha: a float > 1, or a tensor broadcastable to
    X's shape with size 1 along dim (one α per slice); gradients flow to X and to a tensor
    alpha. n_iter bounds the root-finding steps (safeguarded Newton, not plain bisection:
    converged rows stop after about 10). ensure_sum_one divides by the sum at the final τ.
    α = 2 is sparsemax; α → 1 tends to softmax, with float32 accuracy degrading as
    eps / (α − 1). See the README for the contract (dtypes, -inf, NaN).
    """
    dim = check_input(X, dim, NAME)
    _check_n_iter(n_iter)
    if X.dim() == 0:
        return entmax_bisect(X.reshape(1), alpha, 0, n_iter, ensure_sum_one).reshape(())
    alpha = _alpha_per_slice(alpha, X, dim)
    ensure_sum_one = bool(ensure_sum_one)
    if uses_kernels(X) and launchable(X):
        return _EagerEntmaxBisect.apply(X, alpha, dim, n_iter, ensure_sum_one)
    return _entmax_bisect_op(X, alpha, dim, n_iter, ensure_sum_one)


class EntmaxBisect(nn.Module):
    """Module form of `flashmax.entmax_bisect`, as `entmax.EntmaxBisect(alpha, dim, n_iter)`."""

    def __init__(self, alpha=1.5, dim: int = -1, n_iter: int = 50):
        super().__init__()
        self.alpha = alpha
        self.dim = dim
        self.n_iter = n_iter

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return entmax_bisect(X, alpha=self.alpha, dim=self.dim, n_iter=self.n_iter)

    def extra_repr(self) -> str:
        alpha = self.alpha
        if isinstance(alpha, torch.Tensor):
            alpha = f"tensor of shape {tuple(alpha.shape)}" if alpha.numel() > 1 else alpha.item()
        return f"alpha={alpha}, dim={self.dim}, n_iter={self.n_iter}"
