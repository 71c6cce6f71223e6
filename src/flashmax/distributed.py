"""Sparsemax (and entmax-1.5, at the end) over a feature dimension split across the ranks of
a torch.distributed group.

Each rank holds a contiguous slice of every row (tensor-parallel vocabularies, experts); the
result on each rank is its slice of the sparsemax of the whole row. Only per-row scalars cross
ranks, never the features:

1. one all_gather of a small fixed-size description of each rank's input, so that ranks that
   disagree (rows, dtype, dim, gradient) all raise the same ValueError instead of hanging;
2. one all_gather of each rank's (max, exact tau of its own slice relative to that max): every
   rank then takes each row's max (z = x - max, tau in [-1, 0), as on one device) and the
   highest slice's tau in those coordinates, a lower bound on the row's tau (the tau of any
   subset of a row is <= the row's tau);
3. steps from that bound, one collective each for all rows: an all_gather of each rank's
   (sum, count, smallest) of z - t over z > t at `ladder` points t per row, reduced in rank
   order on every rank (identical numbers, so identical decisions on every rank). The points
   are the Newton point t0 (a lower bound) and a ladder over the bracket [t0, hi] at
   t0 + (hi - t0) / 2^k up to the midpoint (hi: the lowest point seen with f < 0; at first 0).
   Each step keeps the highest point with f >= 0, takes the Newton step from it, and lowers
   hi to the lowest point with f < 0.

Newton from a lower bound rises monotonically to the exact tau; the smallest entry of the
support lets the step that lands be recognised final (as on one device). The ladder's points
cost nothing but a wider collective, and a start nearer tau saves whole steps (each a round
trip between ranks): from the slices' bound, rows of randn usually end in one or two steps.
The bracket at least halves per step, and once no float is left inside it the Newton step from
its lower end is exact: so the steps are capped by the floating-point resolution of tau
(|tau| >= 1 / width), `max_steps`, and the answer stays exact.

The local work is pure torch on CPU tensors and Triton kernels on CUDA tensors
(`flashmax.kernels.distributed`: the single-device split passes, which read the slice once and
then only the candidates above each chunk's bound; each step's update is one small kernel).
Whether to go on is decided on the host, from the rows' "done" flags; the host may read a
step's flags only after queueing the next `lookahead` steps (a step queued after the last
repeats the answer, unchanged), so as not to leave the device idle for a round trip. On two
H200s the steps are bound by the host's launches, not the device, and reading each step's
flags at once was the faster (`TritonShard.lookahead`).
"""

import math

import torch
import torch.distributed as dist

from . import reference, reference_entmax
from .entmax import entmax15
from .sparsemax import SUPPORTED_DTYPES, check_input, compute_dtype, sparsemax, uses_kernels

from .kernels import load as load_kernels

kernels = load_kernels("distributed")


# Points per row and step: the Newton point and a ladder over the bracket (a power of 2 >= 2).
LADDER = 8


def max_steps(width: int, dtype: torch.dtype) -> int:
    """Hard cap on the steps: the bracket starts at most 1 wide and at least halves per step;
    it holds no float once narrower than the spacing at |tau| >= 1 / width."""
    mantissa = -math.log2(torch.finfo(dtype).eps)
    return math.ceil(math.log2(max(width, 1)) + mantissa) + 3


class Collectives:
    """The collectives of one call, on per-row scalars; `trace` records (kind, shape, dtype)."""

    def __init__(self, group, trace=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.trace = trace

    def _record(self, kind, t):
        if self.trace is not None:
            self.trace.append((kind, tuple(t.shape), t.dtype))

    def all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        self._record("all_reduce_max" if op == dist.ReduceOp.MAX else "all_reduce_sum", t)
        dist.all_reduce(t, op=op, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape]: every rank's t, in rank order."""
        self._record("all_gather", t)
        out = t.new_empty((self.world * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(out, t.contiguous(), group=self.group)
        return out.view(self.world, *t.shape)


# ----------------------------------------------------------------------------------------------
# Agreement between ranks
# ----------------------------------------------------------------------------------------------

_FIELDS = ("valid", "dtype", "ndim", "dim", "rows", "shape", "needs_grad", "cuda", "width")


def _describe(x, dim, name):
    """This rank's input as _FIELDS, and the error its input alone deserves (or None)."""
    try:
        dim = check_input(x, dim, name)
    except (TypeError, IndexError) as error:
        return [0] * len(_FIELDS), error
    shape = x.shape if x.dim() else (1,)
    others = shape[:dim] + shape[dim + 1:]
    needs_grad = torch.is_grad_enabled() and x.requires_grad
    # hash() of a tuple of ints is the same in every process (no hash randomisation for ints).
    fields = [1, SUPPORTED_DTYPES.index(x.dtype), len(shape), dim, math.prod(others),
              hash(tuple(others)), int(needs_grad), int(x.is_cuda), shape[dim]]
    return fields, None


def _meta_device(x, group):
    """Where the descriptions travel: the device that the group's backend serves (NCCL: this
    rank's GPU, gloo: the CPU), whatever x is; with a backend per device type, x's device."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" or not isinstance(x, torch.Tensor):
        return torch.device("cpu")
    return x.device


def _say(fields):
    f = dict(zip(_FIELDS, fields))
    return (f"{f['rows']} rows, dtype {SUPPORTED_DTYPES[f['dtype']]}, dim {f['dim']} of "
            f"{f['ndim']}, {'cuda' if f['cuda'] else 'cpu'}, "
            f"{'needs' if f['needs_grad'] else 'no'} gradient")


def agree(x, dim, comm: Collectives, name: str = "sparsemax") -> tuple[int, int, list[int]]:
    """(dim, rows, every rank's slice width) once all ranks agree on everything else; else the
    same error on every rank (a rank with a bad input raises its own TypeError or IndexError)."""
    fields, error = _describe(x, dim, name)
    everyone = comm.all_gather(torch.tensor(fields, device=_meta_device(x, comm.group))).tolist()
    if error is not None:
        raise error
    invalid = [rank for rank, f in enumerate(everyone) if not f[0]]
    if invalid:
        raise ValueError(f"{name}(group=...): the input of rank(s) {invalid} is invalid "
                         "(see the error raised there)")
    if any(f[:-1] != fields[:-1] for f in everyone):
        ranks = "; ".join(f"rank {r}: {_say(f)}" for r, f in enumerate(everyone))
        raise ValueError(
            f"{name}(group=...): all ranks must pass the same rows (shape apart from dim), "
            f"dtype, dim, device type and need for a gradient; got {ranks}")
    return fields[3], fields[4], [f[-1] for f in everyone]


# ----------------------------------------------------------------------------------------------
# Local work of one rank, pure torch (CPU, or any device without Triton)
# ----------------------------------------------------------------------------------------------


def _as_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t as (rows, width) with dim last; width 0 allowed (a rank without features)."""
    others = t.shape[:dim] + t.shape[dim + 1:]
    return t.movedim(dim, -1).reshape(math.prod(others), t.shape[dim])


def _from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """`_as_rows` undone: a contiguous tensor of like's shape and dtype."""
    shape = like.movedim(dim, -1).shape
    return rows.to(like.dtype).view(shape).movedim(-1, dim).contiguous()


class SliceRows:
    """One rank's slice as (rows, width) in the compute dtype, and what sparsemax and
    entmax-1.5 do alike with it: z = (x - row max) * SCALE in the whole rows' coordinates, the
    slice's own exact tau, and the output from the row's threshold."""

    SCALE = 1.0

    def __init__(self, x: torch.Tensor, dim: int):
        self.x, self.dim = x, dim
        self.ctype = compute_dtype(x.dtype)
        self.rows = _as_rows(x, dim).to(self.ctype)
        self.z = None

    def _shifted(self, row_max: torch.Tensor) -> torch.Tensor:
        """(x - row_max) * SCALE, -inf where row_max is not finite."""
        z = self.rows - row_max.unsqueeze(-1)
        if self.SCALE != 1.0:
            z.mul_(self.SCALE)
        return z.masked_fill_(~torch.isfinite(row_max).unsqueeze(-1), -torch.inf)

    def summary(self) -> torch.Tensor:
        """[2, rows]: this slice's max (NaN where it holds one) and its exact tau relative to
        that max (-inf where the max is not finite)."""
        if not self.rows.shape[1]:
            return self.rows.new_full((2, self.rows.shape[0]), -torch.inf)
        local_max = self.rows.amax(-1)
        pivot, step = self._threshold(self._shifted(local_max))
        return torch.stack([local_max,
                            torch.where(torch.isfinite(local_max), pivot + step, -torch.inf)])

    def _z(self, row_max: torch.Tensor) -> torch.Tensor:
        """The slice in the whole rows' coordinates (-inf in bad rows), made once."""
        if self.z is None:
            self.z = self._shifted(row_max)
        return self.z

    def write(self, row_max: torch.Tensor, pivot: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        y = self._outputs(self._z(row_max), pivot, step)
        y.masked_fill_(~torch.isfinite(row_max).unsqueeze(-1), torch.nan)
        return _from_rows(y, self.x, self.dim)


class TorchShard(SliceRows):
    """Sparsemax's local work in pure torch; the same interface as
    `flashmax.kernels.distributed.TritonShard`."""

    # Newton steps queued before the driver reads whether an earlier one finished every row:
    # none here, where reading costs no device synchronisation.
    lookahead = 0

    @staticmethod
    def _threshold(z):
        return reference.threshold(z)

    @staticmethod
    def _outputs(z, pivot, step):
        return reference.sparsemax_outputs(z, pivot, step)[0]

    def sums(self, row_max: torch.Tensor, taus: torch.Tensor, centre: torch.Tensor):
        """[points, 3, rows] float64: sum, count and smallest of d = z - tau over d > 0, for
        each row's tau at each point (NaN: a finished row, whose results are ignored).

        The sum is that of d - centre (centre near 1 / count: terms that nearly cancel, so
        nearly exact in the compute dtype) plus count * centre in float64.
        """
        d = self._z(row_max) - taus.unsqueeze(-1)
        support = d > 0
        total = torch.where(support, d - centre.unsqueeze(-1), 0).sum(-1)
        count = support.sum(-1)
        smallest = torch.where(support, d, torch.inf).amin(-1) if d.shape[-1] else total + torch.inf
        total = total.double() + count.double() * centre.double()
        return torch.stack([total, count.double(), smallest.double()], 1)

    @staticmethod
    def advance(everyone, points, pivot, step, done, hi):
        """One step's update from every rank's sums (`everyone` [world, ladder, 3, rows], in
        rank order): (pivot, step, done, hi, centre, the next step's points)."""
        stats = _reduce_ranks(everyone)
        pivot, step, done, hi, count = _advance(stats, points, pivot, step, done, hi)
        # The next step's centre: 1 / the count at the point its Newton step started from.
        centre = torch.where(count > 0, 1 / count, 0).to(pivot.dtype)
        return pivot, step, done, hi, centre, next_points(pivot, step, hi, done, points.shape[0])

def torch_support_sums(y: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor:
    """[2, rows] float64: sum of grad and count over the support y > 0 of each row."""
    ctype = compute_dtype(y.dtype)
    y_rows, g_rows = (_as_rows(t, dim).to(ctype) for t in (y, grad))
    support = y_rows > 0
    total = torch.where(support, g_rows, 0).sum(-1)
    return torch.stack([total.double(), support.sum(-1).double()])


def torch_backward_write(y: torch.Tensor, grad: torch.Tensor, mean: torch.Tensor, dim: int):
    ctype = compute_dtype(y.dtype)
    mean = mean.to(ctype).view(*y.movedim(dim, -1).shape[:-1], 1).movedim(-1, dim)
    dx = torch.where(y > 0, grad.to(ctype) - mean, 0)
    return dx.to(y.dtype).contiguous()


def _local_work(x: torch.Tensor, dim: int):
    if uses_kernels(x) and kernels is not None:
        return kernels.TritonShard(x, dim)
    return TorchShard(x, dim)


# ----------------------------------------------------------------------------------------------
# The sharded forward and backward
# ----------------------------------------------------------------------------------------------


def ladder_fractions(ladder: int) -> list[float]:
    """Where a step's points lie in its bracket [tau, hi]: tau, then geometrically up to the
    midpoint (0, 2^(1 - ladder), ..., 1/4, 1/2). Newton rises from below, so tau is usually
    close under the root: the points crowd there, and the midpoint still halves the bracket."""
    return [0.0] + [2.0 ** (j - ladder) for j in range(1, ladder)]


def next_points(pivot, step, hi, done, ladder):
    """[ladder, rows], ascending: a step's points tau + (hi - tau) * fraction, tau = pivot +
    step (the products are exact: the fractions are powers of 2); NaN for finished rows."""
    tau = pivot + step
    fractions = torch.tensor(ladder_fractions(ladder), dtype=tau.dtype, device=tau.device)
    points = tau + (hi - tau) * fractions[:, None]
    return points.masked_fill_(done, torch.nan)


def _reduce_ranks(everyone):
    """Every rank's [world, points, 3, rows] (sum, count, smallest), summed and min-ed in rank
    order: the same computation on the same numbers on every rank, so identical results."""
    sums = everyone[:, :, :2].sum(0)
    smallest = everyone[:, :, 2:].amin(0)
    return torch.cat([sums, smallest], 1)


def combine(summaries, scale: float = 1.0):
    """Every rank's `summary` [world, 2, rows] -> each row's max (+inf where a rank holds a NaN
    or +inf: a bad row) and a lower bound on its tau, the highest slice's tau in the row's
    coordinates z = (x - max) * scale; the same numbers in the same order on every rank."""
    local_max, local_tau = summaries[:, 0], summaries[:, 1]
    local_max = torch.where(local_max.isnan(), torch.inf, local_max)
    row_max = local_max.amax(0)
    taus = torch.where(local_max.isfinite(), (local_max - row_max) * scale + local_tau,
                       -torch.inf)
    return row_max, taus.amax(0).clamp_min(-1.0)


def _all_done(done, host=None):
    """A function that says whether every row is done, reading `done` as of now in stream
    order; on CUDA it waits for that point of the stream only, not for later work, through
    `host` (a 0-dim bool in pinned memory, not used before; allocated if None)."""
    flag = done.all()
    if not flag.is_cuda:
        return lambda: bool(flag)
    if host is None:
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()

    def read():
        ready.synchronize()
        return bool(host)

    return read


def _advance(stats, points, pivot, step, done, hi):
    """One step's update from the reduced sums at each row's ladder of points [ladder, rows]:
    (pivot, step, done, hi, the count at the point the Newton step started from)."""
    ladder = points.shape[0]
    # f(point) >= 0: a lower bound. The points ascend and f descends: the lower bounds are a
    # prefix (taken as one even if rounding broke it), and the Newton point is always one.
    below = stats[:, 0] >= 1
    below[0] = True
    prefix = below.cumprod(0).sum(0)
    best = (prefix - 1)[None]
    total, count, smallest = stats.gather(0, best[:, None].expand(1, 3, -1))[0]
    start = points.gather(0, best)[0]
    new_pivot, new_step, new_done = reference.newton_update(
        total, count, smallest, start, torch.zeros_like(start), done)
    pivot = torch.where(done, pivot, new_pivot)
    step = torch.where(done, step, new_step)
    above = points.gather(0, prefix.clamp_max(ladder - 1)[None])[0]
    hi = torch.where(done | (prefix == ladder), hi, above)
    # No float left between tau and hi, hence no data point: the Newton step from tau is exact.
    closed = ~(points[ladder - 1] > points[0])
    return pivot, step, new_done | closed, hi, count


def sharded_forward(x, dim, comm: Collectives, width: int, local=None, ladder=None):
    """This rank's slice of the sparsemax of the whole rows, and the number of steps.

    `width` is the whole rows' width. Tests override the local work (`local`: Triton kernels
    on CPU tensors under the interpreter) and the points per step (`ladder`, default LADDER).
    """
    local = _local_work(x, dim) if local is None else local
    ladder = LADDER if ladder is None else ladder
    row_max, bound = combine(comm.all_gather(local.summary()))
    bad = ~torch.isfinite(row_max)
    pivot, step, done = bound, torch.zeros_like(bound), bad
    hi = torch.zeros_like(bound)
    centre = torch.zeros_like(bound)  # 1 / the last count: see TorchShard.sums
    points = next_points(pivot, step, hi, done, ladder)
    # Each queued step's "every row done", read local.lookahead steps later, so that the host
    # queues the next steps while the device works (a step after the last only repeats it).
    cap = max_steps(width, bound.dtype)
    # The flags' host copies, one per step, allocated once (pinned memory is slow to allocate).
    flags = torch.empty(cap + 1, dtype=torch.bool, pin_memory=done.is_cuda)
    finished = [_all_done(done, flags[0])]
    steps = 0
    while steps < cap:
        if len(finished) > local.lookahead and finished.pop(0)():
            break
        everyone = comm.all_gather(local.sums(row_max, points, centre))
        pivot, step, done, hi, centre, points = local.advance(
            everyone, points, pivot, step, done, hi)
        steps += 1
        finished.append(_all_done(done, flags[steps]))
    return local.write(row_max, pivot, step), steps


def sharded_backward(y, grad, dim, comm: Collectives):
    """dx = s * (g - mean of g over the whole row's support s = (y > 0)): one all-reduce."""
    on_kernels = uses_kernels(y) and kernels is not None
    support_sums = kernels.support_sums if on_kernels else torch_support_sums
    backward_write = kernels.backward_write if on_kernels else torch_backward_write
    total, count = comm.all_reduce(support_sums(y, grad, dim), dist.ReduceOp.SUM)
    return backward_write(y, grad, total / count, dim)


# A custom op cannot take a ProcessGroup argument, so the sharded sparsemax is a plain
# autograd.Function (torch.compile graph-breaks on it, as on any collective-issuing Python).
class _ShardedSparsemax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm, width):
        y, _ = sharded_forward(x, dim, comm, width)
        ctx.save_for_backward(y)
        ctx.dim, ctx.comm = dim, comm
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return _ShardedSparsemaxBackward.apply(y, grad, ctx.dim, ctx.comm), None, None, None


class _ShardedSparsemaxBackward(torch.autograd.Function):
    """dx is linear in grad (the same projection again) and locally constant in y."""

    @staticmethod
    def forward(ctx, y, grad, dim, comm):
        ctx.save_for_backward(y)
        ctx.dim, ctx.comm = dim, comm
        return sharded_backward(y, grad, dim, comm)

    @staticmethod
    def backward(ctx, grad_dx):
        (y,) = ctx.saved_tensors
        return None, _ShardedSparsemaxBackward.apply(y, grad_dx, ctx.dim, ctx.comm), None, None


def sharded_sparsemax(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`flashmax.sparsemax(x, dim, group=group)`: x is this rank's contiguous slice of the
    features along dim (slices may differ in width, 0 included), in rank order."""
    if dist.get_world_size(group) == 1:
        return sparsemax(x, dim)
    comm = Collectives(group)
    dim, rows, widths = agree(x, dim, comm)
    if not rows or not sum(widths):
        # Nothing to normalise on any rank: no collective, in the forward or the backward.
        return sparsemax(x, dim)
    if x.dim() == 0:
        return _ShardedSparsemax.apply(x.reshape(1), 0, comm, sum(widths)).reshape(())
    return _ShardedSparsemax.apply(x, dim, comm, sum(widths))


# ----------------------------------------------------------------------------------------------
# entmax-1.5: the same protocol, with sparsemax's Newton points replaced by the reference's
# steps (closed form of the set above tau, else Newton on F); local work in pure torch
# ----------------------------------------------------------------------------------------------


class Entmax15Shard(SliceRows):
    """entmax-1.5's local work, in z = (x - row max) / 2."""

    SCALE = 0.5

    @staticmethod
    def _threshold(z):
        return reference_entmax.entmax15_threshold(z, z.new_full(z.shape[:1], -1.0))

    @staticmethod
    def _outputs(z, pivot, step):
        return reference_entmax.entmax15_outputs(z, pivot, step)

    def sums(self, row_max: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """[4, rows] float64: the reference's `support_sums` of this slice at tau."""
        sums = reference_entmax.support_sums(self._z(row_max) - tau.unsqueeze(-1))
        return torch.stack([t.double() for t in sums])


def sharded_entmax15_forward(x, dim, comm: Collectives):
    """This rank's slice of the entmax-1.5 of the whole rows, and the number of steps: one
    all_gather of the slices' (max, tau), then one all_gather of the sums per step, reduced in
    rank order on every rank (identical decisions, so no rank waits on a step the others
    skip). Capped as the reference is (`reference_entmax.MAX_STEPS`, against rounding cycles)."""
    local = Entmax15Shard(x, dim)
    row_max, pivot = combine(comm.all_gather(local.summary()), scale=0.5)
    step = torch.zeros_like(pivot)
    done = ~torch.isfinite(row_max)
    steps = 0
    while steps < reference_entmax.MAX_STEPS and not bool(done.all()):
        tau = pivot + step
        everyone = comm.all_gather(local.sums(row_max, tau))
        s1, s2, count = everyone[:, :3].sum(0)
        new_step, finished = reference_entmax.threshold_step(
            s1, s2, count, everyone[:, 3].amin(0).to(tau.dtype), tau)
        pivot = torch.where(done, pivot, tau)
        step = torch.where(done, step, new_step)
        done = done | finished
        steps += 1
    return local.write(row_max, pivot, step), steps


def sharded_entmax15_backward(y, grad, dim, comm: Collectives):
    """dx = s g - (sum(s g) / sum(s)) s with s = sqrt(y) over the whole rows: one all-reduce."""
    ctype = compute_dtype(y.dtype)
    s = _as_rows(y, dim).to(ctype).sqrt()
    sg = s * _as_rows(grad, dim).to(ctype)
    sums = torch.stack([sg.sum(-1, dtype=torch.float64), s.sum(-1, dtype=torch.float64)])
    total, norm = comm.all_reduce(sums, dist.ReduceOp.SUM)
    return _from_rows(sg - (total / norm).to(ctype).unsqueeze(-1) * s, y, dim)


class _FirstOrderOnly(torch.autograd.Function):
    """dx itself, whose own gradient raises. torch's once_differentiable would leave dx with no
    gradient at all when the incoming grad does not require one (a gradient penalty's ones),
    so a term built on dx would silently add nothing to a second-order gradient."""

    @staticmethod
    def forward(ctx, dx, *inputs):
        return dx.view_as(dx)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("flashmax.entmax15(group=...) has first-order gradients only: its "
                           "gradient cannot be differentiated again")


class _ShardedEntmax15(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        y, _ = sharded_entmax15_forward(x, dim, comm)
        ctx.save_for_backward(y)
        ctx.dim, ctx.comm = dim, comm
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        with torch.no_grad():
            dx = sharded_entmax15_backward(y, grad, ctx.dim, ctx.comm)
        if torch.is_grad_enabled():  # create_graph: dx depends on y, which requires grad
            dx = _FirstOrderOnly.apply(dx, y, grad)
        return dx, None, None


def sharded_entmax15(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`flashmax.entmax15(x, dim, group=group)`, as `sharded_sparsemax` (first-order gradients
    only: a double backward raises)."""
    if dist.get_world_size(group) == 1:
        return entmax15(x, dim)
    comm = Collectives(group)
    dim, rows, widths = agree(x, dim, comm, "entmax15")
    if not rows or not sum(widths):
        return entmax15(x, dim)
    if x.dim() == 0:
        return _ShardedEntmax15.apply(x.reshape(1), 0, comm).reshape(())
    return _ShardedEntmax15.apply(x, dim, comm)
