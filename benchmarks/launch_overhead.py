"""Where the host time of an eager sparsemax call goes, at 2048 x 1024 fp32.

Prints, for each layer from a bare kernel launch to forward + backward through autograd, the
median host time of one call (not synchronised), and for the end-to-end rows also the time per
call of 2000 calls in a row (synchronised once: what a training loop sees), next to
torch.softmax and an autograd.Function that only clones. `--json PATH` writes the table.
"""
import json
import statistics
import sys
import time

import torch
import triton

import flashmax
from flashmax.kernels import sparsemax as kernels
from flashmax.kernels.launch import tensor_key
from flashmax.sparsemax import check_input


def host_us(fn, reps=300):
    """Median host time of one call."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def loop_us(fn, calls=2000, runs=5):
    """Median over runs of the time per call of `calls` calls and one synchronisation."""
    results = []
    for _ in range(runs):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        results.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(results)


ROUNDS = 5  # of the end-to-end loops


class CloneFunction(torch.autograd.Function):
    """The least a Python autograd op can cost: one clone each way."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


def main():
    x = torch.randn(2048, 1024, device="cuda", requires_grad=True)
    xd = x.detach()
    y = kernels.sparsemax_forward(xd, 1)  # keeps the forward's plan
    key = (1, *tensor_key(xd))
    kept = kernels.FORWARD_LAUNCHES.plans[key]  # a `direct_launch`
    kept_vars = dict(zip(kept.__code__.co_freevars,
                         (cell.cell_contents for cell in kept.__closure__)))
    runner, grid, scalars = kept_vars["runner"], kept_vars["grid"], kept_vars["scalars"]
    compiled = next(cell.cell_contents for cell in runner.__closure__  # CompiledKernel[grid]'s
                    if isinstance(cell.cell_contents, triton.compiler.CompiledKernel))
    launcher, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    args, pointers = (xd, y, *scalars), (xd.data_ptr(), y.data_ptr(), *scalars)
    device = xd.get_device()

    def stream():
        return torch._C._cuda_getCurrentRawStream(device)

    def launcher_call(tensors):
        return lambda: launcher(*grid, stream(), function, metadata, None, None, None, *tensors)

    def c_launch(tensors):  # the C function's arguments as Triton 3.6 orders them
        return lambda: launcher.launch(*grid, stream(), function, launcher.launch_cooperative_grid,
                                       launcher.launch_pdl, None, None, metadata, None, None,
                                       None, *tensors)

    def step(op):
        def run():
            out = op(x)
            torch.autograd.grad(out, x, out)
        return run

    single = {
        "torch.empty(shape, dtype, device)": lambda: torch.empty(xd.shape, dtype=xd.dtype,
                                                                 device=xd.device),
        "torch.empty_like": lambda: torch.empty_like(xd),
        "torch.empty_like, contiguous": lambda: torch.empty_like(
            xd, memory_format=torch.contiguous_format),
        "x.clone()": lambda: xd.clone(),
        "tensor_key(x, y)": lambda: tensor_key(xd, y),
        "raw stream": stream,
        "check_input + is_compiling": lambda: (check_input(xd, -1),
                                               torch.compiler.is_compiling()),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "torch._C._cuda_getDevice()": torch._C._cuda_getDevice,
        "x.data_ptr() twice": lambda: (xd.data_ptr(), y.data_ptr()),
        "CompiledKernel[grid] runner": lambda: runner(*args),
        "launcher": launcher_call(args),
        "launcher, pointers as ints": launcher_call(pointers),
        "C launch (triton 3.6)": c_launch(args),
        "C launch (triton 3.6), pointers as ints": c_launch(pointers),
        "kept launch (direct_launch)": lambda: kept((xd, y)),
        "kept_launch (output, key, launch)": lambda: kernels.kept_launch(
            kernels.FORWARD_LAUNCHES, True, 1, None, xd),
        "kernels.sparsemax_forward": lambda: kernels.sparsemax_forward(xd, 1),
        "kernels.sparsemax_backward": lambda: kernels.sparsemax_backward(y, xd, 1),
        "CloneFunction.apply (grad)": lambda: CloneFunction.apply(x),
        "flashmax.sparsemax (no grad)": lambda: flashmax.sparsemax(xd),
        "flashmax.sparsemax (grad)": lambda: flashmax.sparsemax(x),
        "torch.softmax (grad)": lambda: torch.softmax(x, -1),
    }
    end_to_end = {
        "softmax fwd+bwd": step(lambda t: torch.softmax(t, -1)),
        "autograd.Function(clone) fwd+bwd": step(CloneFunction.apply),
        "sparsemax fwd+bwd": step(flashmax.sparsemax),
        "entmax15 fwd+bwd": step(flashmax.entmax15),
    }
    if "--profile" in sys.argv:  # where the host time of forward + backward goes, by Python call
        host_us(end_to_end["sparsemax fwd+bwd"])  # compiled and kept first
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    with_stack=True) as prof:
            for _ in range(50):
                end_to_end["sparsemax fwd+bwd"]()
        print(prof.key_averages(group_by_stack_n=3).table(sort_by="self_cpu_time_total",
                                                          row_limit=25, max_name_column_width=60))
    results = {"torch": torch.__version__, "triton": triton.__version__,
               "device": torch.cuda.get_device_name(), "host_us": {}, "loop_us": {}}

    def measure(rows, suffix="", loop=False):
        for name, fn in rows.items():
            try:
                results["host_us"][name + suffix] = host_us(fn)
                if loop:
                    results["loop_us"][name + suffix] = loop_us(fn)
            except Exception as error:  # a layer this Triton release lays out otherwise
                print(f"{name}: {type(error).__name__}: {error}")

    measure(single)
    # The end-to-end loops in ROUNDS rounds (the host's speed drifts), each against softmax's
    # of the same round. To compare a change, patch it in and out in alternate rounds.
    for round_ in range(ROUNDS):
        measure(end_to_end, f", round {round_}", loop=True)
    print(results["torch"], results["triton"], results["device"])
    for name, value in results["host_us"].items():
        loop = results["loop_us"].get(name)
        print(f"{name:46} {value:8.1f} us host" + ("" if loop is None else
                                                  f"   {loop:8.1f} us a call in a loop"))
    for op in end_to_end:
        ratios = [results["loop_us"][f"{op}, round {round_}"]
                  / results["loop_us"][f"softmax fwd+bwd, round {round_}"]
                  for round_ in range(ROUNDS)]
        results.setdefault("loop_ratio_to_softmax", {})[op] = ratios
        print(f"{op} loop / softmax's, per round: {' '.join(f'{r:.2f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f})")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
