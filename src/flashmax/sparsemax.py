"""Sparsemax as PyTorch custom ops: validation, device dispatch, autograd, public API.

CUDA tensors run the Triton kernels in `flashmax.kernels.sparsemax`; every other tensor (or any
tensor when Triton is missing) runs the exact pure-torch path in `flashmax.reference`.
Results are always contiguous tensors of the input's shape, so fake and real layouts agree.

Eager calls on CUDA skip the custom-op dispatcher, whose Python layers cost about as much host
time as a small kernel takes on the GPU, through `_EagerSparsemax`, a thin autograd.Function
over the same kernels (bit-identical results; `eager_function`), or the forward launcher alone
when autograd has nothing to record (Function.apply costs ~5 µs of host time); torch.compile
always sees the custom op.
"""

import operator

import torch
from torch import nn

from . import reference

from .kernels import load as load_kernels

kernels = load_kernels("sparsemax")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 are computed in fp32 and rounded once; fp32 and fp64 in themselves."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def uses_kernels(x: torch.Tensor) -> bool:
    return kernels is not None and x.is_cuda


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_input(x: torch.Tensor, dim: int, name: str = "sparsemax") -> int:
    """Validate x and dim; return dim as a non-negative index."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name}: expected a float16, bfloat16, float32 or float64 tensor, got dtype {x.dtype}"
        )
    try:
        dim = operator.index(dim)  # ints and their kin (numpy integers), not floats or strings
    except TypeError:
        raise TypeError(f"{name}: dim must be an int, got {type(dim).__name__}") from None
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(
            f"{name}: dim {dim} is out of range for a tensor of {x.dim()} dimensions "
            f"(expected in [{-ndim}, {ndim - 1}])"
        )
    return dim % ndim


def on_rows(fn, dim: int, *tensors: torch.Tensor) -> torch.Tensor:
    """fn over the last dim of the tensors moved there (views) in their compute dtype; the
    result back in the first tensor's dtype and layout, contiguous."""
    first = tensors[0]
    if not first.numel():
        return first.new_empty(first.shape)
    ctype = compute_dtype(first.dtype)
    result = fn(*(t.movedim(dim, -1).to(ctype) for t in tensors))
    return result.to(first.dtype).movedim(-1, dim).contiguous()


@torch.library.custom_op("flashmax::sparsemax", mutates_args=())
def _sparsemax_op(x: torch.Tensor, dim: int) -> torch.Tensor:
    if uses_kernels(x):
        return kernels.sparsemax_forward(x, dim)
    return on_rows(reference.sparsemax_forward, dim, x)


@_sparsemax_op.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("flashmax::sparsemax_backward", mutates_args=())
def _sparsemax_backward_op(y: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor:
    if uses_kernels(y):
        return kernels.sparsemax_backward(y, grad, dim)
    return on_rows(reference.sparsemax_backward, dim, y, grad)


@_sparsemax_backward_op.register_fake
def _(y: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor:
    return y.new_empty(y.shape)


def register_output_autograd(op, backward_op) -> None:
    """Autograd for an op (x, dim) -> y whose gradient is backward_op(y, grad, dim)."""

    def setup_context(ctx, inputs, output):
        ctx.dim = inputs[1]
        ctx.save_for_backward(output)

    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return backward_op(y, grad, ctx.dim), None

    op.register_autograd(backward, setup_context=setup_context)


register_output_autograd(_sparsemax_op, _sparsemax_backward_op)


def _setup_backward_context(ctx, inputs, output):
    ctx.dim = inputs[2]
    ctx.save_for_backward(inputs[0])


def _double_backward(ctx, grad_dx):
    # dx is linear in grad (the same projection again) and locally constant in y.
    (y,) = ctx.saved_tensors
    return None, _sparsemax_backward_op(y, grad_dx, ctx.dim), None


_sparsemax_backward_op.register_autograd(_double_backward, setup_context=_setup_backward_context)


def batch_first(info, in_dims, args) -> list:
    """An op's arguments under torch.vmap with the batch dim of each tensor first (an unbatched
    tensor expanded to the batch, a view)."""
    return [arg.movedim(bdim, 0) if bdim is not None
            else arg.expand(info.batch_size, *arg.shape) if isinstance(arg, torch.Tensor)
            else arg for arg, bdim in zip(args, in_dims)]


def register_rowwise_vmap(op, dim_arg: int) -> None:
    """torch.vmap for a row-wise op whose argument dim_arg is the reduced dim of its tensors
    (all with as many dims: x, or y and grad, and entmax_bisect's alpha): one call over the
    whole batch, moved to the front, instead of torch's fallback of one call a sample.
    Outputs (one tensor or a tuple) come batched first."""

    def vmap_rule(info, in_dims, *args):
        logical = next(arg.dim() - (bdim is not None) for arg, bdim in zip(args, in_dims)
                       if isinstance(arg, torch.Tensor))
        args = batch_first(info, in_dims, args)
        args[dim_arg] = args[dim_arg] % max(logical, 1) + 1
        out = op(*args)
        return out, (0,) * len(out) if isinstance(out, tuple) else 0

    op.register_vmap(vmap_rule)


register_rowwise_vmap(_sparsemax_op, 1)
register_rowwise_vmap(_sparsemax_backward_op, 2)


# Tensor types the launchers take as they are; subclasses (FakeTensor, DTensor, ...) are the
# custom ops' to dispatch.
PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def launchable(t: torch.Tensor) -> bool:
    """Whether the kernels' launchers can take t directly: outside torch.compile's tracing, a
    plain tensor with storage, not a subclass, outside any vmap (torch.func's transforms, or
    autograd's batched gradients, the legacy vmap: their tensors are wrappers without storage).
    Elsewhere the custom ops serve: their fake implementations and vmap rules
    (`register_rowwise_vmap`). is_compiling goes first: dynamo cannot trace the C calls."""
    return (not torch.compiler.is_compiling() and type(t) in PLAIN_TENSORS
            and not torch._C._are_functorch_transforms_active()
            and not torch._C._functorch.is_legacy_batchedtensor(t))


def eager_function(name: str, forward, backward, backward_op) -> type:
    """An autograd.Function `name` over a pair of kernel launchers, forward(x, dim) -> y and
    backward(y, grad, dim) -> dx, for eager CUDA calls; with create_graph or under vmap the
    gradient is backward_op (the custom op, itself differentiable and batched) instead."""

    def forward_fn(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        y = forward(x, dim)
        ctx.save_for_backward(y)
        ctx.dim = dim
        return y

    def backward_fn(ctx, grad: torch.Tensor):
        (y,) = ctx.saved_tensors
        # create_graph: the op keeps the gradient differentiable; batched gradients (vmap):
        # the op's dispatch serves them.
        if torch.is_grad_enabled() or not launchable(grad):
            return backward_op(y, grad, ctx.dim), None
        return backward(y, grad, ctx.dim), None

    # type() rather than a class statement: the function and its backward node keep `name`.
    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward_fn), "backward": staticmethod(backward_fn)})


_EagerSparsemax = None if kernels is None else eager_function(
    "_EagerSparsemax", kernels.sparsemax_forward, kernels.sparsemax_backward,
    _sparsemax_backward_op)


def call_rowwise(x: torch.Tensor, dim: int, name: str, op, eager, forward) -> torch.Tensor:
    """The public call of a row-wise op (x, dim) -> y after its arguments are checked: eager
    calls on CUDA through the autograd.Function `eager`, or the forward launcher alone when
    autograd has nothing to record; every other call (other devices, tensors the launchers
    cannot take: torch.compile, vmap, subclasses, `launchable`) through the custom op `op`. eager is None where the
    kernels are missing."""
    dim = check_input(x, dim, name)
    if x.dim() == 0:
        return op(x.reshape(1), 0).reshape(())
    if eager is not None and x.is_cuda and launchable(x):
        if x.requires_grad and torch.is_grad_enabled():
            return eager.apply(x, dim)
        return forward(x, dim)  # nothing to record: the launch alone
    return op(x, dim)


def sparsemax(x: torch.Tensor, dim: int = -1, k=None, *, group=None) -> torch.Tensor:
    """Sparsemax of x along dim: the Euclidean projection of each slice onto the simplex.

    y = max(x - tau, 0) with tau chosen so that each slice sums to 1. Same signature as
    `entmax.sparsemax(X, dim=-1, k=None)`; k (the entmax package's partial-sort size) is
    accepted and ignored. See the README for the full contract (dtypes, -inf, NaN).
    With a torch.distributed `group`, x is this rank's contiguous slice of the features along
    dim and the result its slice of the whole rows' sparsemax (`flashmax.distributed`).
    """
    if group is not None:
        from .distributed import sharded_sparsemax  # imports this module

        return sharded_sparsemax(x, dim, group)
    return call_rowwise(x, dim, "sparsemax", _sparsemax_op, _EagerSparsemax,
                        None if kernels is None else kernels.sparsemax_forward)


class RowwiseModule(nn.Module):
    """Module form of a row-wise function `function(x, dim)`, with the entmax package's
    constructor (dim=-1, k=None; k is accepted and ignored)."""

    function = None

    def __init__(self, dim: int = -1, k=None):
        super().__init__()
        self.dim = dim
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Sparsemax(RowwiseModule):
    """Module form of `flashmax.sparsemax` (as `entmax.Sparsemax(dim=-1, k=None)`)."""

    function = staticmethod(sparsemax)
