"""The sparsemax and entmax-1.5 losses (Fenchel-Young losses) as PyTorch custom ops.

For scores x (classes last) and a target class t, with p = sparsemax(x) or entmax15(x):
loss = <p - onehot(t), x> + omega(p), omega(p) = (1 - sum(p^2)) / 2 for sparsemax and
(1 - sum(p^1.5)) / 0.75 for entmax-1.5, as the entmax package defines them; its gradient is
p - onehot(t). The loss is computed in max-shifted coordinates (exact, as sum(p) = 1), so an
offset costs no precision.

CUDA rows that fit one program run the fused kernel (`flashmax.kernels.entmax.loss`): the forward
reads x once and writes a loss per row, the backward reads x again and writes p - onehot(t),
recomputing p's threshold in registers instead of storing p. Other tensors (and longer rows)
compute p with `flashmax.sparsemax` / `flashmax.entmax15` and the loss with torch.
"""

import math

import torch
from torch import nn

from .entmax import entmax15, kernels, uses_kernels
from .sparsemax import batch_first, check_input, compute_dtype, sparsemax

REDUCTIONS = ("none", "sum", "elementwise_mean", "mean")


def _check_reduction(reduction: str, name: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")


def _target_rows(target: torch.Tensor, classes: int, ignore_index: int):
    """(ignored, invalid, index): the rows whose target is ignore_index; those whose target is
    neither that nor a class (their loss and gradient are NaN); the targets with both set to
    class 0, safe to gather with."""
    ignored = target == ignore_index
    invalid = ((target < 0) | (target >= classes)) & ~ignored
    return ignored, invalid, target.masked_fill(ignored | invalid, 0)


def _check_targets(x: torch.Tensor, target: torch.Tensor, ignore_index: int) -> None:
    """Every target is a class index of x's rows or ignore_index. Only on the CPU: elsewhere it
    would take a host sync (no CUDA graphs), and such rows come out NaN instead."""
    _, invalid, _ = _target_rows(target, x.shape[-1], ignore_index)
    if bool(invalid.any()):
        bad = target[invalid][0].item()
        raise ValueError(
            f"target {bad} is out of range for {x.shape[-1]} classes "
            f"(expected 0 <= target < {x.shape[-1]} or ignore_index={ignore_index})"
        )


def _prediction(x: torch.Tensor, use_entmax15: bool) -> torch.Tensor:
    return entmax15(x) if use_entmax15 else sparsemax(x)


def _loss_rows(x: torch.Tensor, target: torch.Tensor, ignore_index: int,
               use_entmax15: bool) -> torch.Tensor:
    """The loss of each row of a 2-D x in its compute dtype, with torch ops."""
    ignored, invalid, index = _target_rows(target, x.shape[-1], ignore_index)
    if not x.shape[-1]:  # no classes: every row is ignored or invalid
        return x.new_zeros(x.shape[:1]).masked_fill(invalid, math.nan)
    p = _prediction(x, use_entmax15)
    z = x - x.amax(-1, keepdim=True)
    if use_entmax15:
        omega = (1 - (p * p.sqrt()).sum(-1)) / 0.75
    else:
        omega = (1 - (p * p).sum(-1)) / 2
    z_target = z.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    # -inf entries have p = 0 and take no part (0 * -inf would be NaN).
    loss = torch.where(p > 0, p * z, 0).sum(-1) - z_target + omega
    return loss.masked_fill(invalid, math.nan).masked_fill(ignored, 0)


def _gradient_rows(x, target, grad_loss, ignore_index, use_entmax15):
    """grad_loss * (p - onehot(target)) per row of a 2-D x in its compute dtype."""
    ignored, invalid, index = _target_rows(target, x.shape[-1], ignore_index)
    if not x.numel():
        return x.new_zeros(x.shape)
    dx = _prediction(x, use_entmax15)
    dx.scatter_add_(-1, index.unsqueeze(-1),
                    torch.where(ignored | invalid, 0, -1).to(dx.dtype).unsqueeze(-1))
    dx = dx * grad_loss.unsqueeze(-1)
    return dx.masked_fill_(invalid.unsqueeze(-1), math.nan).masked_fill_(ignored.unsqueeze(-1), 0)


def _fused(x: torch.Tensor) -> bool:
    return uses_kernels(x) and kernels.loss_fits(x.shape[-1], x.dtype)


@torch.library.custom_op("flashmax::sparse_loss", mutates_args=())
def _loss_op(x: torch.Tensor, target: torch.Tensor, ignore_index: int,
             use_entmax15: bool) -> torch.Tensor:
    if x.device.type == "cpu":
        _check_targets(x, target, ignore_index)
    if _fused(x):
        return kernels.loss(x, target, ignore_index, use_entmax15)
    loss = _loss_rows(x.to(compute_dtype(x.dtype)), target, ignore_index, use_entmax15)
    return loss.to(x.dtype)


@_loss_op.register_fake
def _(x, target, ignore_index, use_entmax15):
    return x.new_empty(x.shape[:1])


@torch.library.custom_op("flashmax::sparse_loss_backward", mutates_args=())
def _loss_backward_op(x: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor,
                      ignore_index: int, use_entmax15: bool) -> torch.Tensor:
    if _fused(x):
        return kernels.loss(x, target, ignore_index, use_entmax15,
                            grad_loss=grad_loss.contiguous())
    ctype = compute_dtype(x.dtype)
    dx = _gradient_rows(x.to(ctype), target, grad_loss.to(ctype), ignore_index, use_entmax15)
    return dx.to(x.dtype)


@_loss_backward_op.register_fake
def _(x, target, grad_loss, ignore_index, use_entmax15):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, target, ctx.ignore_index, ctx.use_entmax15 = inputs
    ctx.save_for_backward(x, target)


def _backward(ctx, grad_loss):
    x, target = ctx.saved_tensors
    dx = _loss_backward_op(x, target, grad_loss, ctx.ignore_index, ctx.use_entmax15)
    return dx, None, None, None


_loss_op.register_autograd(_backward, setup_context=_setup_context)


def _setup_backward_context(ctx, inputs, output):
    x, target, grad_loss, ctx.ignore_index, ctx.use_entmax15 = inputs
    ctx.save_for_backward(x, target, grad_loss)


def _double_backward(ctx, grad_dx):
    """dx = g (p - onehot) per row: for x, g times p's Jacobian (symmetric) applied to grad_dx;
    for g, <grad_dx, p - onehot> per row."""
    x, target, grad_loss = ctx.saved_tensors
    with torch.enable_grad():
        x = x.detach().requires_grad_()
        p = _prediction(x, ctx.use_entmax15)
    ignored, invalid, index = _target_rows(target, x.shape[-1], ctx.ignore_index)
    ignored, invalid = ignored.unsqueeze(-1), invalid.unsqueeze(-1)
    weights = grad_dx.masked_fill(ignored, 0) * grad_loss.unsqueeze(-1)
    (grad_x,) = torch.autograd.grad(p, x, weights)
    onehot = torch.nn.functional.one_hot(index, x.shape[-1])
    grad_g = (grad_dx * (p.detach() - onehot)).masked_fill(ignored, 0).sum(-1)
    return (grad_x.masked_fill(invalid, math.nan), None,
            grad_g.masked_fill(invalid.squeeze(-1), math.nan), None, None)


_loss_backward_op.register_autograd(_double_backward, setup_context=_setup_backward_context)


def register_rows_vmap(op) -> None:
    """torch.vmap for a loss op, whose tensors hold one row each along their first dim: the
    batch folded into the rows, one call for the whole batch."""

    def vmap_rule(info, in_dims, *args):
        args = [arg.flatten(0, 1) if isinstance(arg, torch.Tensor) else arg
                for arg in batch_first(info, in_dims, args)]
        return op(*args).unflatten(0, (info.batch_size, -1)), 0

    op.register_vmap(vmap_rule)


register_rows_vmap(_loss_op)
register_rows_vmap(_loss_backward_op)


def _loss(x, target, ignore_index, reduction, use_entmax15, name):
    check_input(x, -1, name)
    _check_reduction(reduction, name)
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int32, torch.int64):
        got = target.dtype if isinstance(target, torch.Tensor) else type(target).__name__
        raise TypeError(f"{name}: target must be an int64 or int32 tensor, got {got}")
    if x.dim() < 1:
        raise ValueError(f"{name}: scores need a classes (last) dimension, got a 0-d tensor")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{name}: target shape {tuple(target.shape)} must be the scores' shape "
                         f"without the classes (last) dimension, {tuple(x.shape[:-1])}")
    rows = target.reshape(-1).to(torch.int64)
    loss = _loss_op(x.reshape(rows.numel(), x.shape[-1]), rows, ignore_index, use_entmax15)
    loss = loss.view(target.shape)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


def sparsemax_loss(x: torch.Tensor, target: torch.Tensor, k=None, ignore_index: int = -100,
                   reduction: str = "none") -> torch.Tensor:
    """The sparsemax loss of scores x [..., classes] for class indices target [...].

    Compatible with `entmax.sparsemax_loss(X, target, k=None)`, which returns the loss of each
    row (reduction="none"); k is accepted and ignored (flashmax is exact). Rows whose target is
    ignore_index give 0. reduction: "none", "sum", "elementwise_mean" or "mean" (the sum over
    the rows not ignored, divided by their number).
    """
    return _loss(x, target, ignore_index, reduction, False, "sparsemax_loss")


def entmax15_loss(x: torch.Tensor, target: torch.Tensor, k=None, ignore_index: int = -100,
                  reduction: str = "none") -> torch.Tensor:
    """The entmax-1.5 loss, as `sparsemax_loss` (compatible with `entmax.entmax15_loss`)."""
    return _loss(x, target, ignore_index, reduction, True, "entmax15_loss")


class SparsemaxLoss(nn.Module):
    """Module form of `sparsemax_loss`, as `entmax.SparsemaxLoss(k=None, ignore_index=-100,
    reduction="elementwise_mean")`."""

    def __init__(self, k=None, ignore_index: int = -100, reduction: str = "elementwise_mean"):
        super().__init__()
        _check_reduction(reduction, type(self).__name__)
        self.k = k
        self.ignore_index = ignore_index
        self.reduction = reduction

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return sparsemax_loss(x, target, ignore_index=self.ignore_index, reduction=self.reduction)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}"


class Entmax15Loss(SparsemaxLoss):
    """Module form of `entmax15_loss`, as `entmax.Entmax15Loss(k=100, ignore_index=-100,
    reduction="elementwise_mean")`."""

    def __init__(self, k=100, ignore_index: int = -100, reduction: str = "elementwise_mean"):
        super().__init__(k, ignore_index, reduction)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return entmax15_loss(x, target, ignore_index=self.ignore_index, reduction=self.reduction)
