"""`flashmax.kernels.launch.LaunchCache` with a stand-in kernel: what it keeps, under which key,
and what a replay passes to the compiled launcher. (On a GPU, test_kernels' repeated-call test
runs it on the real kernels; under the interpreter nothing is kept.)"""

import pytest
import torch

pytest.importorskip("triton")

from triton.compiler import CompiledKernel  # noqa: E402

from flashmax.kernels import launch  # noqa: E402


class FakeCompiled(CompiledKernel):
    """A compiled kernel whose launcher records its calls (no GPU, no constructor)."""

    def __init__(self, calls):  # not CompiledKernel's, which needs a compilation
        self.calls = calls

    def __getitem__(self, grid):
        def run(*args):
            self.calls.append(("replay", grid, args))
        return run


class FakeKernel:
    """What LaunchCache uses of a JITFunction: arg_names and kernel[grid](*args, **options)."""

    arg_names = ["X", "Y", "n", "stride", "BLOCK", "FLAG"]

    def __init__(self, compiled=True):
        self.calls = []
        self.compiled = compiled

    def __getitem__(self, grid):
        def launch_(*args, **options):
            self.calls.append(("jit", grid, args, options))
            return FakeCompiled(self.calls) if self.compiled else None
        return launch_


def test_a_kept_launch_is_replayed_with_every_parameter_in_order():
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
    assert kind == "replay" and grid3 == (7, 1, 1)
    assert replayed[0] is x2 and replayed[1] is y2 and replayed[2:] == (5, 1, 8, True)


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


def test_kept_launch_replays_only_with_the_launchers_defaults():
    from flashmax.kernels.sparsemax import kept_launch

    cache = launch.LaunchCache(FakeKernel())
    x = torch.randn(3, 5)
    out, key, replayed = kept_launch(cache, True, 1, None, x)
    assert key is not None and not replayed and out.shape == x.shape and out is not x
    cache.launch(key, (3,), (x, out), (5, 1), dict(BLOCK=8, FLAG=False))
    again, same_key, replayed = kept_launch(cache, True, 1, None, x)
    assert replayed and same_key == key and again is not out
    replayed_args = cache.kernel.calls[-1][2]
    assert replayed_args[0] is x and replayed_args[1] is again  # into the new output
    mine = torch.empty(3, 5)
    out, key, replayed = kept_launch(cache, False, 1, mine, x)
    assert out is mine and key is None and not replayed
