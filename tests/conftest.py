import os

import pytest

# The Triton interpreter must be chosen before triton is first imported (flashmax imports it).
# On a machine with a GPU, FLASHMAX_TEST_DEVICE=cuda runs the same tests on the compiled kernels.
if os.environ.get("FLASHMAX_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    """FLASHMAX_TEST_SHARD=i/n keeps every n-th collected test from the i-th (0-based), so that a
    GPU run can spread one large file over several processes (`benchmarks/gpu_tests.sh`)."""
    shard = os.environ.get("FLASHMAX_TEST_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    if not 0 <= index < count:
        raise ValueError(f"FLASHMAX_TEST_SHARD={shard}: want i/n with 0 <= i < n")
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items)
                                         if i % count != index])
    items[:] = items[index::count]


@pytest.fixture
def record_launches(monkeypatch):
    """record_launches(cache) -> the list to which each launch of that `LaunchCache` appends
    its options instead of running (with `out=` no launch is kept to replay, so every call
    launches)."""
    def record(cache):
        launched = []
        monkeypatch.setattr(cache, "launch",
                            lambda key, grid, tensors, scalars, options: launched.append(options))
        return launched
    return record


@pytest.fixture
def one_multiprocessor(monkeypatch):
    """Launches sized for one multiprocessor, as off CUDA, on any device: what depends on
    programs a SM (walking rows, register caps from a count of programs) then depends on the
    rows alone."""
    from flashmax.kernels import sparsemax

    monkeypatch.setattr(sparsemax, "_multiprocessors", lambda device: 1)
