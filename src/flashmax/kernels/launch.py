"""Kernel launches that skip Triton's per-call argument handling once a call's plan is known.

`kernel[grid](*args)` binds and specialises every argument in Python on each call: ~25 µs of
host time on an H200's host, where the compiled kernel's own launcher takes ~9 µs
(benchmarks/NOTES.md, v13), about as long as a whole small sparsemax takes on the GPU.
A `LaunchCache` keeps, per key, the compiled kernel that a launch chose with its grid and
scalar arguments, and `replay` launches it on new tensors directly. The key is the caller's
promise that everything the launch was derived from is in it: `tensor_key` covers the shapes,
strides, dtypes, 16-byte alignment (which Triton specialises on) and device of the tensors.
Under TRITON_INTERPRET=1 a launch returns no compiled kernel, so nothing is kept.

Triton launches on the current CUDA device; `on_tensor_device` makes a launcher's first
tensor's device the current one while it runs, as PyTorch's own ops do.
"""

import functools

import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel

MAX_PLANS = 4096  # distinct keys kept per kernel; then the cache starts over


def tensor_key(*tensors) -> tuple:
    """What a launch over these tensors (all on one device) may depend on, besides the
    caller's own arguments."""
    return (tensors[0].get_device(),
            *((t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) for t in tensors))


def on_tensor_device(launcher):
    """launcher(x, ...) run with x's CUDA device current (Triton launches there: a tensor of
    another device would fail, "Pointer argument cannot be accessed from Triton")."""

    @functools.wraps(launcher)
    def on_device(x, *args, **kwargs):
        index = x.get_device()
        # torch.cuda.current_device() without its lazy-initialisation check: x is a CUDA tensor.
        if index < 0 or index == torch._C._cuda_getDevice():
            return launcher(x, *args, **kwargs)
        with torch.cuda.device(index):
            return launcher(x, *args, **kwargs)

    return on_device


def _hooked() -> bool:
    """Whether a launch hook (a profiler's, e.g. proton) is set: HookChains (triton >= 3.5)
    with calls, or a hook function (earlier releases)."""
    hooks = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


# Releases whose CUDA launcher passes its arguments on, in the order `_launcher` gives, to its
# C function when the kernel needs no scratch memory (checked on the H200 with 3.6.0; 3.9's
# C function takes others).
C_LAUNCH_RELEASES = ("3.6.",)


def _launcher(compiled: CompiledKernel) -> tuple:
    """(launch, arguments): compiled's kernel launches as
    launch(*grid, stream, kernel handle, *arguments, *the kernel's arguments).
    Triton's launcher takes (packed metadata, launch metadata, enter hook, exit hook); on
    C_LAUNCH_RELEASES its C function is called directly (0.7-1.6 µs a launch less on H200
    hosts, launch_overhead.py in NOTES v48-v51: its Python wrapper only looks up scratch)."""
    launcher = compiled.run
    hooks = (compiled.packed_metadata, None, None, None)
    if (triton.__version__.startswith(C_LAUNCH_RELEASES) and not launcher.global_scratch_size
            and not launcher.profile_scratch_size):
        return launcher.launch, (launcher.launch_cooperative_grid, launcher.launch_pdl,
                                 None, None, *hooks)
    return launcher, hooks


def direct_launch(compiled: CompiledKernel, grid: tuple, scalars: tuple):
    """compiled[grid](*tensors, *scalars) (Triton's runner) as a function of the tensors, with
    what the runner looks up on every launch looked up once: the launcher, the kernel's handle
    and metadata, the current stream's getter and the device (the current one, on which the
    kernel was loaded). Pointers go as integers: for a tensor the launcher asks the driver
    whether its pointer is a device's, on every launch (the key says it is). While a launch
    hook is set the runner launches, with its metadata and the tensors themselves."""
    runner = compiled[grid]  # loads the kernel on the current device
    launch, arguments = _launcher(compiled)
    function = compiled.function
    driver = triton.runtime.driver.active
    device, current_stream = driver.get_current_device(), driver.get_current_stream

    def launch_on(tensors):
        if _hooked():
            runner(*tensors, *scalars)
        else:
            launch(*grid, current_stream(device), function, *arguments,
                   *[t.data_ptr() for t in tensors], *scalars)

    return launch_on


class LaunchCache:
    """Launches of one Triton kernel whose tensor arguments come first."""

    def __init__(self, kernel: triton.JITFunction):
        self.kernel = kernel
        self.plans = {}

    def launch(self, key, grid, tensors, scalars, options) -> None:
        """kernel[grid](*tensors, *scalars, **options), kept for `replay` under key (unless
        key is None)."""
        compiled = self.kernel[grid](*tensors, *scalars, **options)
        if key is None or not isinstance(compiled, CompiledKernel):
            return
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        # The compiled launcher takes every parameter in order, constexprs included.
        named = self.kernel.arg_names[len(tensors) + len(scalars):]
        constexprs = tuple(options[name] for name in named)
        self.plans[key] = direct_launch(compiled, (*grid, 1, 1)[:3], (*scalars, *constexprs))

    def run(self, grid, tensors, scalars, options) -> None:
        """kernel[grid](*tensors, *scalars, **options), replaying the plan kept for the same
        tensors' layout and scalars (a launch repeated within a call, as a Newton step is)."""
        key = (tensor_key(*tensors), scalars)
        if not self.replay(key, *tensors):
            self.launch(key, grid, tensors, scalars, options)

    def replay(self, key, *tensors) -> bool:
        """Launch the plan kept under key on these tensors; False if there is none."""
        plan = self.plans.get(key)
        if plan is None:
            return False
        plan(tensors)
        return True
