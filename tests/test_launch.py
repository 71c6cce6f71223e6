"""`flashmax.kernels.launch.LaunchCache` with a stand-in kernel: what it keeps, under which key,
and what a replay passes to the compiled launcher. (On a GPU, test_kernels' repeated-call test
runs it on the real kernels; under the interpreter nothing is kept.)"""

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.compiler import CompiledKernel  # noqa: E402

from flashmax.kernels import launch  # noqa: E402


class FakeLauncher:
    """A CUDA launcher (CompiledKernel.run) recording its calls and its C function's."""

    launch_cooperative_grid, launch_pdl = "cooperative", "pdl"

    def __init__(self, calls, scratch):
        self.calls = calls
        self.global_scratch_size = self.profile_scratch_size = scratch

    def __call__(self, *args):
        self.calls.append(("replay", args[:3], args[3:]))

    def launch(self, *args):
        self.calls.append(("C launch", args[:3], args[3:]))


class FakeCompiled(CompiledKernel):
    """A compiled kernel whose launcher and runner record their calls (no GPU, no
    constructor)."""

    function, packed_metadata = "function", "metadata"
    module = None  # nothing loaded (CompiledKernel.__del__ looks)

    def __init__(self, calls, scratch=0):
        self.calls = calls
        self.scratch = scratch

    @property
    def run(self):  # CompiledKernel's launcher (a property there too)
        return FakeLauncher(self.calls, self.scratch)

    def __getitem__(self, grid):
        def runner(*args):
            self.calls.append(("runner", grid, args))
        return runner


class FakeDriver:
    """What `direct_launch` asks of Triton's active driver."""

    @staticmethod
    def get_current_device():
        return 3

    @staticmethod
    def get_current_stream(device):
        return f"stream of {device}"


@pytest.fixture(autouse=True)
def fake_driver(monkeypatch):
    monkeypatch.setattr(triton.runtime.driver, "_active", FakeDriver())


class FakeKernel:
    """What LaunchCache uses of a JITFunction: arg_names and kernel[grid](*args, **options)."""

    arg_names = ["X", "Y", "n", "stride", "BLOCK", "FLAG"]

    def __init__(self, compiled=True, scratch=0):
        self.calls = []
        self.compiled = compiled
        self.scratch = scratch

    def __getitem__(self, grid):
        def launch_(*args, **options):
            self.calls.append(("jit", grid, args, options))
            return FakeCompiled(self.calls, self.scratch) if self.compiled else None
        return launch_


@pytest.fixture(params=["launcher", "C launch"])
def release(request, monkeypatch):
    """Triton's launcher (any release), or its C function (C_LAUNCH_RELEASES)."""
    releases = (triton.__version__,) if request.param == "C launch" else ("no release",)
    monkeypatch.setattr(launch, "C_LAUNCH_RELEASES", releases)
    return request.param


# What the launch takes between the kernel's handle and the kernel's arguments: the packed
# metadata and no launch metadata or hooks, after the C function's cooperative-grid, PDL and
# (no) scratch arguments.
LAUNCH_OPTIONS = {"launcher": ("metadata", None, None, None),
                  "C launch": ("cooperative", "pdl", None, None, "metadata", None, None, None)}


def test_a_kept_launch_is_replayed_with_every_parameter_in_order(release):
    kernel = FakeKernel()
    cache = launch.LaunchCache(kernel)
    x, y = torch.randn(3, 5), torch.empty(3, 5)
    key = (1, *launch.tensor_key(x))
    assert not cache.replay(key, x, y)
    cache.launch(key, (7,), (x, y), (5, 1), dict(BLOCK=8, FLAG=True, num_warps=2))
    x2, y2 = torch.randn(3, 5), torch.empty(3, 5)
    assert cache.replay(key, x2, y2)
    (_, grid, args, options), (kind, grid3, replayed) = kernel.calls
    assert options == dict(BLOCK=8, FLAG=True, num_warps=2) and grid == (7,)
    assert kind == ("replay" if release == "launcher" else release) and grid3 == (7, 1, 1)
    # The stream of the device the kernel was loaded on, the kernel, no launch hooks.
    options = LAUNCH_OPTIONS[release]
    assert replayed[:2 + len(options)] == ("stream of 3", "function", *options)
    # Tensors as their pointers, then the scalars and constexprs.
    assert replayed[2 + len(options):] == (x2.data_ptr(), y2.data_ptr(), 5, 1, 8, True)


def test_a_kernel_with_scratch_memory_launches_through_the_launcher(release):
    kernel = FakeKernel(scratch=16)  # the launcher allocates it
    cache = launch.LaunchCache(kernel)
    x, y = torch.randn(2, 2), torch.empty(2, 2)
    cache.launch("k", (2,), (x, y), (2, 1), dict(BLOCK=2, FLAG=False))
    assert cache.replay("k", x, y)
    kind, _, replayed = kernel.calls[-1]
    assert kind == "replay" and replayed[2:6] == LAUNCH_OPTIONS["launcher"]


def test_with_a_launch_hook_set_the_runner_launches(monkeypatch):
    hook = triton.knobs.HookChain() if hasattr(triton.knobs, "HookChain") else None
    if hook is None:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    else:
        hook.add(lambda metadata: None)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    kernel = FakeKernel()
    cache = launch.LaunchCache(kernel)
    x, y = torch.randn(2, 2), torch.empty(2, 2)
    cache.launch("k", (2,), (x, y), (2, 1), dict(BLOCK=2, FLAG=False))
    assert cache.replay("k", x, y)
    kind, grid3, args = kernel.calls[-1]
    assert kind == "runner" and grid3 == (2, 1, 1) and args[0] is x and args[2:] == (2, 1, 2, False)


def test_nothing_is_kept_without_a_key_or_a_compiled_kernel():
    x, y = torch.randn(2, 2), torch.empty(2, 2)
    for kernel, key in ((FakeKernel(), None), (FakeKernel(compiled=False), ("k",))):
        cache = launch.LaunchCache(kernel)
        cache.launch(key, (1,), (x, y), (2, 1), dict(BLOCK=2, FLAG=False))
        assert not cache.plans and not cache.replay(key, x, y)


def test_keys_tell_layouts_apart():
    base = torch.randn(4, 9)
    aligned, offset = base[:, :8], base[:, 1:]  # the same shape and strides, 4 bytes apart
    assert aligned.shape == offset.shape and aligned.stride() == offset.stride()
    keys = {launch.tensor_key(t) for t in (aligned, offset, base[1:, :8], base[:, ::2],
                                           aligned.double(), aligned.contiguous())}
    assert len(keys) == 6


def test_the_cache_starts_over_when_full(monkeypatch):
    monkeypatch.setattr(launch, "MAX_PLANS", 2)
    cache = launch.LaunchCache(FakeKernel())
    x, y = torch.randn(2, 2), torch.empty(2, 2)
    for key in range(3):
        cache.launch(key, (1,), (x, y), (2, 1), dict(BLOCK=2, FLAG=False))
    assert list(cache.plans) == [2]


def test_kept_launch_replays_only_with_the_launchers_defaults(release):
    from flashmax.kernels.sparsemax import kept_launch

    cache = launch.LaunchCache(FakeKernel())
    x = torch.randn(3, 5)
    out, key, replayed = kept_launch(cache, True, 1, None, x)
    assert key is not None and not replayed and out.shape == x.shape and out is not x
    cache.launch(key, (3,), (x, out), (5, 1), dict(BLOCK=8, FLAG=False))
    again, same_key, replayed = kept_launch(cache, True, 1, None, x)
    assert replayed and same_key == key and again is not out
    replayed_args = cache.kernel.calls[-1][2][2 + len(LAUNCH_OPTIONS[release]):]
    assert replayed_args[:2] == (x.data_ptr(), again.data_ptr())  # into the new output
    mine = torch.empty(3, 5)
    out, key, replayed = kept_launch(cache, False, 1, mine, x)
    assert out is mine and key is None and not replayed


class DeviceTensor:
    """A stand-in for a tensor on CUDA device `index` (-1: the CPU)."""

    def __init__(self, index):
        self.index = index

    def get_device(self):
        return self.index


def test_launchers_run_on_their_tensors_device(monkeypatch):
    entered = []

    class Device:  # torch.cuda.device, recording the device made current
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "device", Device)
    seen = []

    @launch.on_tensor_device
    def launcher(x, scale, *, out=None):
        seen.append((x.index, scale, out, list(entered)))
        return scale

    assert launcher(DeviceTensor(1), 2, out="o") == 2
    assert launcher(DeviceTensor(0), 3) == 3 and launcher(DeviceTensor(-1), 4) == 4
    assert seen == [(1, 2, "o", [1]), (0, 3, None, [1, "exit"]), (-1, 4, None, [1, "exit"])]
