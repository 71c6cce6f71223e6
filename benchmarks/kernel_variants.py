"""Check and time kernel variants of sparsemax (or entmax-1.5, --op) on a GPU in one call; a
short table last.

    python benchmarks/kernel_variants.py [--quick]     (writes $OUT/variants-OP.json when OUT is set)

Each variant is checked against the fp64 oracle on the input it is timed on, with its output
poisoned first; each backward against the oracle's gradient at the oracle's output. Times are
GPU time from CUDA-graph replay over enough distinct inputs that every input is read cold from
HBM (their total is several times the L2), median of replays, and are printed as a ratio to
x.clone() of the same shape timed the same way.
"""

import argparse
import itertools
import json
import os
import statistics
import sys
from typing import Callable, NamedTuple

import torch
import triton

from flashmax.kernels import entmax as entmax_kernels
from flashmax.kernels import sparsemax as kernels
from flashmax.reference import sparsemax_backward, sparsemax_sort
from flashmax.reference_entmax import entmax15_backward, entmax15_sort

L2_MULTIPLE_BYTES = 512 * 2**20  # inputs per replay total at least this: ~8x the H200's L2


def cold_inputs(rows, n, itemsize):
    """How many distinct inputs of rows x n entries keep each call's read cold (L2_MULTIPLE_BYTES
    in all, 2 to 64 of them)."""
    return max(2, min(64, L2_MULTIPLE_BYTES // (rows * n * itemsize)))


def make(dist, rows, n, dtype, seed, columns=False):
    """rows x n inputs; with columns, n x rows ones, reduced over dim 0 (a row's entries `rows`
    apart, rows adjacent in memory: an [N, C, H, W] input reduced over C)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (n, rows) if columns else (rows, n)
    x = torch.randn(shape, device="cuda", generator=g)
    if dist == "rand":
        x = torch.rand(shape, device="cuda", generator=g)
    elif dist == "randn0.01":
        x = x * 0.01
    return x.to(dtype)


def gpu_time_us(fn, inputs, replays=15):
    """Median, p20, p80 of GPU time per call, from replaying a graph of fn over all inputs."""
    for x in inputs[:2]:
        fn(x)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(x) for x in inputs]
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(inputs))
    del outs, graph
    times.sort()
    return statistics.median(times), times[len(times) // 5], times[4 * len(times) // 5]


class Op(NamedTuple):
    """What --op times: launchers called on a kernels module (this tree's, or a --baseline's of
    the same file), and the fp64 oracles of the forward's output and of the backward's."""
    module: object
    forward: Callable  # (module, x, out=None, **overrides) -> output of x's shape
    backward: Callable | None  # (module, y, grad, out=None) -> dx
    oracle: Callable  # fp64 x -> the forward's exact output
    backward_oracle: Callable | None = None  # fp64 (y, grad) -> dx, over the last dim


def launcher(name):
    def call(module, *tensors, dim=1, **config):
        return getattr(module, name)(*tensors, dim, **config)
    return call


LOSS_TARGETS = {}


def loss_targets(x):
    """Fixed targets spread over the classes, and a loss gradient of ones, per shape and dtype
    (made once: inside a timed graph they would be kernels too)."""
    rows, n = x.shape
    key = (rows, n, x.dtype, x.device)
    if key not in LOSS_TARGETS:
        LOSS_TARGETS[key] = (torch.arange(rows, device=x.device) * 7919 % n,
                             torch.ones(rows, dtype=x.dtype, device=x.device))
    return LOSS_TARGETS[key]


def loss_op(use_entmax15) -> Op:
    """The fused loss's backward (x in, p - onehot(target) out: the loss's traffic) timed as a
    forward of x, with its oracle."""
    sort = entmax15_sort if use_entmax15 else sparsemax_sort

    def forward(module, x, out=None, **config):
        target, ones = loss_targets(x)
        return module.loss(x, target, -100, use_entmax15, grad_loss=ones, out=out, **config)

    def oracle(x):
        target, _ = loss_targets(x)
        p = sort(x)
        return p - torch.nn.functional.one_hot(target, x.shape[1]).to(p.dtype)
    return Op(entmax_kernels, forward, None, oracle)


OPS = {"sparsemax": Op(kernels, launcher("sparsemax_forward"), launcher("sparsemax_backward"),
                       sparsemax_sort, sparsemax_backward),
       "entmax15": Op(entmax_kernels, launcher("entmax15_forward"),
                      launcher("entmax15_backward"), entmax15_sort, entmax15_backward),
       "sparsemax_loss": loss_op(False), "entmax15_loss": loss_op(True)}


def rel_error(y, ref):
    """y's relative error against the fp64 reference ref."""
    return float((y.double() - ref).norm() / ref.norm())


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DISTS = {torch.float32: ("randn", "rand", "randn0.01"), torch.bfloat16: ("randn", "rand")}
FORWARD_VARIANTS = {
    "default": {},
    "warps/2": {"warps": 0.5},
    "warps*2": {"warps": 2},
}


def default_forward_warps(module, rows, n, dtype):
    """The warps that `module`'s forward (sparsemax's or entmax-1.5's, through sparsemax's
    `rows_launch`) picks for rows of n entries of dtype."""
    x = torch.empty(0, device="cuda", dtype=dtype)
    return kernels.rows_launch(x, rows, n,
                               half_warps=getattr(module, "HALF_ONE_ROW_WARPS", None)).num_warps


def forward_launcher(op, module, config, rows, n, dtype):
    """The forward of `module` (a kernels module) with a variant's overrides for rows of n
    entries of dtype."""
    config = dict(config)
    if "warps" in config:
        default_warps = default_forward_warps(module, rows, n, dtype)
        warps = default_warps * config.pop("warps")
        if not 1 <= warps <= 16:
            return None
        config["num_warps"] = int(warps)

    def forward(x, out=None):
        return op.forward(module, x, out=out, **config)
    return forward


def compiled_forwards(module):
    """The compiled variants so far (any device) of the module's kernels, by identity, with
    their kernel's name: the forward's, and the split passes' of long rows."""
    jitted = [k for k in vars(module).values() if isinstance(k, triton.runtime.JITFunction)]
    return {id(k): (kernel.__name__, k) for kernel in jitted
            for caches in kernel.device_caches.values() for k in caches[0].values()}


def resources(kernels):
    """Registers, spills, shared memory and whether Triton pipelined a load through shared
    memory (cp.async), of each compiled kernel."""
    out = []
    for name, k in kernels:
        k._init_handles()
        out.append(dict(kernel=name, regs=k.n_regs, spills=k.n_spills, shared=k.metadata.shared,
                        pipelined="async_copy_global_to_local" in k.asm.get("ttgir", "")))
    return out


def load_module(path):
    """A kernels module from a file: an earlier version kept to time against in the same run."""
    import importlib.util

    # Named inside flashmax.kernels, so that its relative imports resolve (also to a module
    # loaded before it: a copy of entmax.py may import a copy of sparsemax.py).
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"flashmax.kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def eager_us(fn, x, reps=50):
    """Median wall time of fn(x) including host overhead (synchronised), microseconds."""
    import time

    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(x)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def end_to_end(records, rows):
    """Eager forward + backward through autograd, host included, against torch.softmax called in
    turn with it (`flashmax bench --modes eager`'s timing)."""
    import flashmax
    from flashmax.bench.timing import Budget, measure_alternating

    def train_step(op, x):
        def step():
            y = op(x)
            torch.autograd.grad(y, x, y)
        return step

    for n in (1024, 32768):
        x = torch.randn(rows, n, device="cuda", requires_grad=True)
        ours, softmax = (timing.median_us for timing in measure_alternating(
            train_step(flashmax.sparsemax, x), train_step(lambda t: torch.softmax(t, -1), x),
            x.device, Budget(gpu_ms=100, cpu_runs=0)))
        fwd = eager_us(lambda t: flashmax.sparsemax(t.detach()), x)
        launch = eager_us(lambda t: kernels.sparsemax_forward(t.detach(), 1), x)
        records.append(dict(mode="end-to-end", variant="eager", n=n, rows=rows, dtype="float32",
                            dist="randn", median_us=ours, p20_us=None, p80_us=None,
                            floor_us=softmax, ratio=ours / softmax, rel_error=None,
                            forward_op_us=fwd, forward_launch_us=launch))


def profile_kernels(op, shapes, forwards, dtypes, dists, reps=3):
    """Per-kernel GPU time of each of `forwards` ({name: (kernels module, overrides)}: op's
    forward from that module with those launch overrides), median over calls, in each of
    dtypes and its `dists` (`dists(dtype)`), each call on one of several inputs so that each reads x from HBM, as
    the timings do: which pass of a multi-kernel path holds the time."""
    from torch.profiler import ProfilerActivity, profile

    for (rows, n), dtype in itertools.product(shapes, dtypes):
        n_inputs = cold_inputs(rows, n, dtype.itemsize)
        for dist in dists(dtype):
            inputs = [make(dist, rows, n, dtype, seed) for seed in range(n_inputs)]
            for name, (module, config) in forwards.items():
                op.forward(module, inputs[0], **config)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(reps):
                        for x in inputs:
                            op.forward(module, x, **config)
                    torch.cuda.synchronize()
                times = {}
                for event in prof.events():
                    if event.device_type == torch.autograd.DeviceType.CUDA:
                        times.setdefault(event.name.removesuffix("_kernel"), []).append(
                            event.device_time)
                parts = ", ".join(f"{kernel} {statistics.median(t):.1f}"
                                  for kernel, t in times.items())
                print(f"profile {name} {rows}x{n} {str(dtype)[6:]} {dist}: {parts} (us)",
                      flush=True)
            del inputs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--op", choices=OPS, default="sparsemax")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--forward-only", action="store_true",
                        help="time no backward (a change to the forward alone)")
    parser.add_argument("--end-to-end-only", action="store_true",
                        help="only the eager forward + backward against torch.softmax")
    parser.add_argument("--baseline", metavar="FILE", nargs="+", default=[],
                        help="other kernels modules (an earlier version, a branch's) to time "
                             "in the same run, forward and backward, each as a variant named by "
                             "its file's stem")
    parser.add_argument("--variants-on-shapes", action="store_true",
                        help="time every variant on --shapes, not the default kernel only")
    parser.add_argument("--variants", metavar="JSON",
                        help='forward variants to time instead of the built-in ones, e.g. '
                             '\'{"default": {}, "c8192": {"chunk": 8192}}\'')
    parser.add_argument("--backward-variants", metavar="JSON",
                        help='backward variants to time (every dtype, on --shapes too), e.g. '
                             '\'{"default": {}, "w16": {"num_warps": 16}}\'')
    parser.add_argument("--shapes", nargs="+", metavar="ROWSxN",
                        help="shapes to time with the default kernel only, e.g. 512x131072")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES),
                        help="the dtypes to time (default: both)")
    parser.add_argument("--dists", nargs="+", choices=sorted(set(sum(DISTS.values(), ()))),
                        help="the input distributions to time, of those DISTS gives each dtype "
                             "(default: all of them)")
    parser.add_argument("--columns", action="store_true",
                        help="rows are the columns of contiguous N x ROWS tensors, reduced "
                             "over dim 0 (`make`)")
    parser.add_argument("--profile", action="store_true",
                        help="also print each kernel's GPU time on --shapes (each --baseline's "
                             "too, and with --variants-on-shapes each --variants')")
    args = parser.parse_args()
    dtypes = [dtype for name, dtype in DTYPES.items() if name in args.dtypes]  # DTYPES' order

    def dists(dtype):
        return [dist for dist in DISTS[dtype] if args.dists is None or dist in args.dists]
    widths = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
    shapes = [(args.tokens, n) for n in widths]
    if args.shapes:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes]
    if args.end_to_end_only:
        shapes = []
    baselines = {module.__name__.rsplit(".", 1)[1]: module
                 for module in map(load_module, args.baseline)}
    op = OPS[args.op]
    module = op.module
    oracle, backward_oracle = op.oracle, op.backward_oracle
    reduce = {}  # the launchers' dim, where not their default (the last)
    if args.columns:
        if args.op not in ("sparsemax", "entmax15"):  # the ops with a backward oracle
            parser.error("--columns times sparsemax or entmax15")
        reduce = {"dim": 0}
        oracle = lambda x: op.oracle(x.t()).t()  # noqa: E731
        backward_oracle = lambda y, g: op.backward_oracle(y.t(), g.t()).t()  # noqa: E731
    records = []
    for rows, n in shapes:
        for dtype in dtypes:
            n_inputs = cold_inputs(rows, n, dtype.itemsize)
            for dist in dists(dtype):
                inputs = [make(dist, rows, n, dtype, seed, args.columns)
                          for seed in range(n_inputs)]
                floor = gpu_time_us(lambda x: x.clone(), inputs)[0]
                want_y = oracle(inputs[0].double())  # every variant is checked on inputs[0]
                variants = json.loads(args.variants) if args.variants else FORWARD_VARIANTS
                if args.shapes and not args.variants_on_shapes:
                    variants = {"default": {}}
                launchers = {name: forward_launcher(op, module, {**config, **reduce}, rows, n,
                                                    dtype)
                             for name, config in variants.items()}
                for name, other in baselines.items():
                    launchers[name] = forward_launcher(op, other, reduce, rows, n, dtype)
                untimed_first = True
                for name, fwd in launchers.items():
                    if fwd is None:
                        continue
                    before = compiled_forwards(module)
                    try:
                        y = fwd(inputs[0], out=torch.full_like(inputs[0], float("nan")))
                    except Exception as error:  # a variant that does not compile: say so, go on
                        print(f"variant {name} {rows}x{n} {dtype}: {type(error).__name__}: "
                              f"{str(error)[:300]}", flush=True)
                        continue
                    built = [k for i, k in compiled_forwards(module).items() if i not in before]
                    err = rel_error(y, want_y)
                    if untimed_first:
                        # The arm timed first in a shape read 5-8% high, whichever kernel it
                        # was (NOTES v61): one timing of it is thrown away.
                        gpu_time_us(fwd, inputs)
                        untimed_first = False
                    med, p20, p80 = gpu_time_us(fwd, inputs)
                    records.append(dict(op=args.op, mode="forward", variant=name, n=n, rows=rows,
                                        columns=args.columns,
                                        dtype=str(dtype)[6:], dist=dist, median_us=med,
                                        p20_us=p20, p80_us=p80, floor_us=floor,
                                        ratio=med / floor, rel_error=err,
                                        kernels=resources(built)))
                if op.backward is not None and not args.forward_only:
                    ys = [op.forward(module, x, **reduce) for x in inputs]
                    gs = [torch.randn_like(x) for x in inputs]
                    pairs = list(zip(ys, gs))
                    # The fp64 gradient at the oracle's output (not at the kernel's).
                    want_dx = backward_oracle(want_y, gs[0].double())
                    backward_variants = {"default": {}}
                    if args.backward_variants:
                        backward_variants = json.loads(args.backward_variants)
                    backwards = {name: (module, config)
                                 for name, config in backward_variants.items()}
                    backwards.update({name: (other, {}) for name, other in baselines.items()})
                    for name, (owner, config) in backwards.items():
                        def backward(p, owner=owner, config=config, out=None):
                            return op.backward(owner, p[0], p[1], out=out, **config, **reduce)
                        dx = backward(pairs[0], out=torch.full_like(ys[0], float("nan")))
                        err = rel_error(dx, want_dx)
                        med, p20, p80 = gpu_time_us(backward, pairs)
                        records.append(dict(op=args.op, mode="backward", variant=name, n=n, rows=rows,
                                            columns=args.columns,
                                            dtype=str(dtype)[6:], dist=dist, median_us=med,
                                            p20_us=p20, p80_us=p80, floor_us=1.5 * floor,
                                            ratio=med / (1.5 * floor), rel_error=err))
                    del ys, gs, pairs, want_dx
                del inputs, want_y
                torch.cuda.empty_cache()
            print(f"done {rows}x{n} {dtype}", flush=True)
    if not args.shapes and args.op == "sparsemax":
        end_to_end(records, args.tokens)
    if args.profile and args.shapes:
        profiled = {"default": (module, {})}
        if args.variants_on_shapes and args.variants:
            profiled.update((name, (module, config))
                            for name, config in json.loads(args.variants).items())
        profiled.update((name, (other, {})) for name, other in baselines.items())
        profile_kernels(op, shapes, profiled, dtypes, dists)

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, commit=os.environ.get("FLASHMAX_COMMIT"))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"variants-{args.op}.json"), "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)
    print(meta)
    print(f"{'mode':8} {'variant':11} {'shape':>12} {'dtype':8} {'dist':9} {'us':>8} {'floor':>7} "
          f"{'ratio':>6} {'relerr':>8}")
    for r in records:
        err = "" if r["rel_error"] is None else f"{r['rel_error']:.1e}"
        extra = (f" forward op {r['forward_op_us']:.1f} launch {r['forward_launch_us']:.1f}"
                 if "forward_op_us" in r else "")
        for k in r.get("kernels", []):
            name = k["kernel"].removesuffix("_kernel")
            extra += (f" [{name} {k['regs']}r {k['spills']}sp {k['shared'] // 1024}K"
                      f"{' cp.async' if k['pipelined'] else ''}]")
        shape = f"{r['rows']}x{r['n']}"
        print(f"{r['mode']:8} {r['variant']:11} {shape:>12} {r['dtype']:8} {r['dist']:9} "
              f"{r['median_us']:8.1f} {r['floor_us']:7.1f} {r['ratio']:6.2f} {err:>8}{extra}")


if __name__ == "__main__":
    main()
