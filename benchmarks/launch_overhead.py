"""Where the host time of an eager sparsemax call goes, at 2048 x 1024 fp32: median host
time per call (not synchronised) of each layer, from a bare launch to forward + backward through
autograd, next to torch.softmax and an autograd.Function that only clones. Prints a table."""
import statistics
import sys
import time

import torch
import triton

import flashmax
from flashmax.kernels import sparsemax as kernels


def host_us(fn, reps=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main():
    x = torch.randn(2048, 1024, device="cuda", requires_grad=True)
    xd = x.detach()
    y = torch.empty_like(xd)
    launch = kernels.rows_launch(xd, 2048, 1024)
    strides = (1024, 0, 1)  # (outer, inner, n) of x and of y
    args = (xd, y, 2048, 1024, 1, *strides, *strides)
    meta = dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, GROUP=launch.group, WIDE=False,
                PREFETCH=launch.prefetch, THREAD_ROWS=launch.thread_rows,
                ROW_ALIGN=kernels.row_align(xd, 1024, strides, strides), ADJACENT=False)
    grid = (launch.programs,)
    compiled = kernels.sparsemax_forward_kernel[grid](*args, **meta, num_warps=launch.num_warps)
    stream = torch.cuda.current_stream().cuda_stream
    full_args = (*args, *meta.values())
    from triton import knobs

    def direct():
        compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                     knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *full_args)

    class CloneFunction(torch.autograd.Function):
        """The least a Python autograd op can cost: one clone each way."""

        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad.clone()

    def step(op):
        def run():
            out = op(x)
            torch.autograd.grad(out, x, out)
        return run

    rows = {
        "torch.empty_like": lambda: torch.empty_like(xd),
        "x.clone()": lambda: xd.clone(),
        "jit launch, args ready": lambda: kernels.sparsemax_forward_kernel[grid](
            *args, **meta, num_warps=warps),
        "compiled.run, args ready": direct,
        "kernels.sparsemax_forward": lambda: kernels.sparsemax_forward(xd, 1),
        "flashmax.sparsemax (no grad)": lambda: flashmax.sparsemax(xd),
        "flashmax.sparsemax (grad)": lambda: flashmax.sparsemax(x),
        "kernels.sparsemax_backward": lambda: kernels.sparsemax_backward(y, xd, 1),
        "torch.softmax (grad)": lambda: torch.softmax(x, -1),
        "softmax fwd+bwd": step(lambda t: torch.softmax(t, -1)),
        "sparsemax fwd+bwd": step(flashmax.sparsemax),
        "entmax15 fwd+bwd": step(flashmax.entmax15),
        "autograd.Function(clone) fwd+bwd": step(CloneFunction.apply),
    }
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    if "--profile" in sys.argv:  # where the host time of forward + backward goes, by Python call
        step_fn = rows["sparsemax fwd+bwd"]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    with_stack=True) as prof:
            for _ in range(50):
                step_fn()
        print(prof.key_averages(group_by_stack_n=3).table(sort_by="self_cpu_time_total",
                                                          row_limit=25, max_name_column_width=60))
    for name, fn in rows.items():
        print(f"{name:32} {host_us(fn):8.1f} us host")


if __name__ == "__main__":
    main()
