"""entmax-1.5 as PyTorch custom ops: validation, device dispatch, autograd, public API.

The same structure as `flashmax.sparsemax`: CUDA tensors run the Triton kernels in
`flashmax.kernels.entmax`, every other tensor the exact pure-torch `flashmax.reference_entmax`;
eager CUDA calls skip the dispatcher through `_EagerEntmax15` (`sparsemax.eager_function`),
torch.compile sees the custom op.
"""

import torch

from . import reference_entmax as reference
from .sparsemax import (RowwiseModule, call_rowwise, eager_function, on_rows,
                        register_output_autograd, register_rowwise_vmap)

from .kernels import load as load_kernels

kernels = load_kernels("entmax")


def uses_kernels(x: torch.Tensor) -> bool:
    return kernels is not None and x.is_cuda


@torch.library.custom_op("flashmax::entmax15", mutates_args=())
def _entmax15_op(x: torch.Tensor, dim: int) -> torch.Tensor:
    if uses_kernels(x):
        return kernels.entmax15_forward(x, dim)
    return on_rows(reference.entmax15_forward, dim, x)


@_entmax15_op.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("flashmax::entmax15_backward", mutates_args=())
def _entmax15_backward_op(y: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor:
    if uses_kernels(y):
        return kernels.entmax15_backward(y, grad, dim)
    return on_rows(reference.entmax15_backward, dim, y, grad)


@_entmax15_backward_op.register_fake
def _(y: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor:
    return y.new_empty(y.shape)


register_output_autograd(_entmax15_op, _entmax15_backward_op)


def _setup_backward_context(ctx, inputs, output):
    ctx.dim = inputs[2]
    ctx.save_for_backward(inputs[0], inputs[1])


def _double_backward(ctx, grad_dx):
    """dx = s g - q s with s = sqrt(y), q = sum(s g) / sum(s). dx is linear in g through the
    symmetric J = diag(s) - s s^T / sum(s), so the gradient for g is the same op applied to
    grad_dx; for y (on the support, where ds/dy = 1 / (2 s)) it is (g - q)(h - r) / (2 s) with
    h = grad_dx and r = sum(s h) / sum(s)."""
    y, grad = ctx.saved_tensors
    dim = ctx.dim
    support = y > 0
    s = torch.where(support, y, 1).sqrt()  # 1 off the support keeps every branch finite
    s_sum = torch.where(support, s, 0).sum(dim, keepdim=True)
    q = torch.where(support, s * grad, 0).sum(dim, keepdim=True) / s_sum
    r = torch.where(support, s * grad_dx, 0).sum(dim, keepdim=True) / s_sum
    grad_y = torch.where(support, (grad - q) * (grad_dx - r) / (2 * s), 0)
    return grad_y, _entmax15_backward_op(y, grad_dx, dim), None


_entmax15_backward_op.register_autograd(_double_backward, setup_context=_setup_backward_context)
register_rowwise_vmap(_entmax15_op, 1)
register_rowwise_vmap(_entmax15_backward_op, 2)


_EagerEntmax15 = None if kernels is None else eager_function(
    "_EagerEntmax15", kernels.entmax15_forward, kernels.entmax15_backward,
    _entmax15_backward_op)


def entmax15(x: torch.Tensor, dim: int = -1, k=None, *, group=None) -> torch.Tensor:
    """entmax-1.5 of x along dim (Peters et al., 2019): y = max((x - max x) / 2 - tau, 0)^2 with
    tau chosen so that each slice sums to 1. Exact, without sorting.

    Same signature as `entmax.entmax15(X, dim=-1, k=None)`; k (the entmax package's partial-sort
    size) is accepted and ignored. The contract (dtypes, -inf, NaN) is sparsemax's. With a
    torch.distributed `group`, x is this rank's contiguous slice of the features along dim and
    the result its slice of the whole rows' entmax-1.5 (`flashmax.distributed`; first-order
    gradients).
    """
    if group is not None:
        from .distributed import sharded_entmax15  # imports this module

        return sharded_entmax15(x, dim, group)
    return call_rowwise(x, dim, "entmax15", _entmax15_op, _EagerEntmax15,
                        None if kernels is None else kernels.entmax15_forward)


class Entmax15(RowwiseModule):
    """Module form of `flashmax.entmax15` (as `entmax.Entmax15(dim=-1, k=None)`)."""

    function = staticmethod(entmax15)
