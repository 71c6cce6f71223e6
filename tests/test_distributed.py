"""`flashmax.sparsemax(x, dim, group=...)` with the features split across processes.

One spawn per configuration (gloo with 2 and with 4 processes on 127.0.0.1; with
FLASHMAX_TEST_DEVICE=cuda on a machine with 2 GPUs, also NCCL with 2 processes on CUDA tensors)
runs every case below inside it; each rank writes its cases' outcomes to a file and the parent
asserts them, one test per case. The process group has a timeout and the parent a hard
deadline, so a failure can never hang. Every rank builds the same whole input from a seed and
keeps its slice; results are compared on the whole rows (gathered by the test only) with the
single-process path and the float64 oracle, on the CPU.
"""

import datetime
import importlib.util
import json
import math
import multiprocessing
import os
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import flashmax
from flashmax import distributed
from oracle import oracle
from flashmax import reference_entmax
from test_entmax import check_against_oracle as check_against_entmax15_oracle
from test_sparsemax import (assert_bitwise_equal, check_against_oracle, check_grad, expected_grad,
                            make_input)

GROUP_TIMEOUT_S = 45  # each collective of a rank whose peer died fails after this
DEADLINE_S = 150  # the whole spawn, start-up included, on a loaded 2-core CI machine
ROOT = Path(__file__).resolve().parent.parent
ON_GPU = os.environ.get("FLASHMAX_TEST_DEVICE", "cpu") == "cuda"
CONFIGS = {"gloo-2": ("gloo", 2), "gloo-4": ("gloo", 4)}
if ON_GPU and torch.cuda.device_count() >= 2:
    CONFIGS["nccl-2"] = ("nccl", 2)
ALL = tuple(CONFIGS)
# The Triton kernels run on CPU tensors only under the interpreter (not with a GPU).
INTERPRETED = () if ON_GPU else ("gloo-2",)
KERNEL_DEVICE = "cuda" if ON_GPU else "cpu"
WORLD = None  # dist.group.WORLD, once the worker has joined
DEVICE = None  # this rank's device: the CPU under gloo, its own GPU under NCCL

CASES = {}


def case(*configs):
    """Register a case, run by every rank of each of these configurations (where present)."""

    def register(fn):
        CASES[fn.__name__] = (fn, [config for config in configs if config in CONFIGS])
        return fn

    return register


# ----------------------------------------------------------------------------------------------
# Helpers run inside the ranks
# ----------------------------------------------------------------------------------------------


def splits(n: int, world: int) -> list[list[int]]:
    """Slice widths that add up to n: even, a rank with 1 feature, a rank with 0 features."""
    def even(total, parts):
        return [len(part) for part in torch.arange(total).tensor_split(parts)]

    rest = even(n - 1, world - 1)
    return [even(n, world), [1] + rest, rest[::-1] + [1], [0] + even(n, world - 1)]


def my_slice(x: torch.Tensor, dim: int, widths: list[int]) -> torch.Tensor:
    """This rank's slice on its device: on the CPU a view (strided unless dim is outermost)."""
    rank = dist.get_rank()
    return x.narrow(dim, sum(widths[:rank]), widths[rank]).to(DEVICE)


def whole(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's t on the CPU, concatenated along dim (test-side only: the features travel)."""
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, t.detach().cpu())
    return torch.cat(pieces, dim)


def check_split(x: torch.Tensor, dim: int, widths, what: str, grad: bool = True, **kwargs):
    """Forward on the slices against the oracle on the whole rows; backward against the
    single-process gradient of the whole rows."""
    x_local = my_slice(x, dim, widths).requires_grad_(grad)
    y_local = flashmax.sparsemax(x_local, dim, group=WORLD, **kwargs)
    assert y_local.shape == x_local.shape and y_local.is_contiguous(), what
    y = whole(y_local, dim)
    try:
        check_against_oracle(y, x, dim)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None
    if grad:
        g = make_input(x.shape, dim, x.dtype, seed=7)
        y_local.backward(my_slice(g, dim, widths))
        check_grad(whole(x_local.grad, dim), expected_grad(y.detach(), g, dim), g, what)


def adversarial_rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that stress the threshold: ties, offsets, scales, masks, near-max, bad rows."""
    g = torch.Generator().manual_seed(n)
    base = torch.randn(16, n, generator=g, dtype=torch.float64)
    rows = [
        base[0],
        base[1] * 1e-3,
        base[2] * 1e3,
        base[3] + 1e4,
        base[4] * 1e-3 - 1e4,
        torch.full((n,), 2.5, dtype=torch.float64),  # all tied
        torch.rand(n, generator=g, dtype=torch.float64) * 0.999,  # all within 1 of the max
        torch.linspace(0, 1, n, dtype=torch.float64),  # one long ramp across every rank
        torch.linspace(1, 0, n, dtype=torch.float64) ** 3,
        (-torch.arange(n, dtype=torch.float64)).exp2(),  # geometric: the max alone dominates
        torch.where(torch.arange(n) % 3 == 0, base[5], -math.inf),  # -inf mask
        torch.where(torch.arange(n) < n - 1, -math.inf, base[6]),  # only the last entry finite
        base[7].index_fill(0, torch.tensor([n // 2]), math.nan),  # NaN: a NaN row
        base[8].index_fill(0, torch.tensor([n - 1]), math.inf),  # +inf: a NaN row
        torch.full((n,), -math.inf, dtype=torch.float64),  # all -inf: a NaN row
        base[9].round(),  # ties at several levels
    ]
    return torch.stack(rows).to(dtype)


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


def check_every_dim_dtype_and_split(check, world, halves, kinds):
    """check(x, dim, widths, what) on rows of 23 along each dim of a [3, 4, 2]-like shape.
    4 processes share 2 cores in CI: world 4 takes only the splits with a 1-feature rank and
    with a 0-feature rank (the same code paths)."""
    chosen_splits = splits(23, world) if world == 2 else splits(23, world)[1::2]
    for dtype in (torch.float32, torch.float64, *halves):
        for dim in range(3):
            shape = [3, 4, 2]
            shape[dim] = 23
            for kind, seed in kinds:
                x = make_input(shape, dim, dtype, seed=seed + 10 * dim, kind=kind, mask_p=0.2)
                for widths in chosen_splits:
                    check(x, dim, widths, f"{dtype} dim={dim} {kind} widths={widths}")


@case(*ALL)
def every_dim_dtype_and_split(rank, world):
    halves = (torch.float16, torch.bfloat16) if world == 2 else ()
    kinds = (("randn", 1), ("ties", 2), ("near_max", 3), ("spike", 4))[::1 if world == 2 else 3]
    check_every_dim_dtype_and_split(check_split, world, halves, kinds)


@case(*ALL)
def adversarial_rows_fp32_fp64(rank, world):
    for dtype in (torch.float32, torch.float64):
        for n in (5, 64, 257):
            x = adversarial_rows(n, dtype)
            for widths in splits(n, world):
                check_split(x, 1, widths, f"{dtype} n={n} widths={widths}")


@case(*ALL)
def newton_steps_and_collectives_bounded(rank, world):
    """Per-row scalars only: 2 collectives + one per step, steps within 1 + log2(n)."""
    for n, kind in ((1000, "randn"), (4096, "randn"), (1000, "spike"), (257, "near_max")):
        x = make_input((64, n), 1, torch.float32, seed=n, kind=kind)
        widths = splits(n, world)[0]
        comm = distributed.Collectives(WORLD, trace=[])
        distributed.agree(my_slice(x, 1, widths), -1, comm)
        y_local, steps = distributed.sharded_forward(my_slice(x, 1, widths), 1, comm, n)
        check_against_oracle(whole(y_local, 1), x, 1)
        assert 1 <= steps <= 1 + math.ceil(math.log2(n)), (n, kind, steps)
        kinds = [kind for kind, _, _ in comm.trace]
        assert kinds == ["all_gather"] * (2 + steps)
        for _, shape, _ in comm.trace:
            per_row = 3 * distributed.LADDER
            assert math.prod(shape) <= per_row * 64, f"a collective of shape {shape}: not per-row"


@case(*ALL)
def every_ladder_is_exact(rank, world):
    """With 2 points per step (Newton and the bracket's midpoint) or more: exact, within
    max_steps, each step one collective of the ladder's sums; the same with the host reading
    the flags late."""
    for dtype in (torch.float32, torch.float64):
        x = torch.cat([adversarial_rows(200, dtype),
                       make_input((8, 200), 1, dtype, seed=5, kind="spike")])
        for ladder in (2, 4, 16):
            for widths in splits(200, world)[:2]:
                comm = distributed.Collectives(WORLD, trace=[])
                y_local, steps = distributed.sharded_forward(
                    my_slice(x, 1, widths), 1, comm, 200, ladder=ladder)
                check_against_oracle(whole(y_local, 1), x, 1)
                assert steps <= distributed.max_steps(200, dtype), steps
                assert comm.trace[-1][1] == (ladder, 3, x.shape[0]), comm.trace[-1]
                # The host reading each step's flags 2 steps late: the steps queued past the
                # last repeat it, so the output is the same.
                late = distributed._local_work(my_slice(x, 1, widths), 1)
                late.lookahead = 2
                y_late, late_steps = distributed.sharded_forward(
                    my_slice(x, 1, widths), 1, distributed.Collectives(WORLD), 200, local=late,
                    ladder=ladder)
                torch.testing.assert_close(y_late, y_local, rtol=0, atol=0, equal_nan=True,
                                           msg=f"ladder {ladder}, widths {widths}")
                assert steps <= late_steps <= min(steps + 2, distributed.max_steps(200, dtype))


@case(*INTERPRETED)
def triton_kernels_under_the_interpreter(rank, world):
    """The CUDA path's local work (Triton, run by the interpreter on CPU tensors) in the
    distributed loop, with chunks of 8 or 4 so that rows span several programs: rows of ties
    whose chunks store no candidates, NaN/+inf/-inf rows, a rank without features, a strided
    slice, chunks re-read by the write (sparse_write=1), group maxima, the row pass's tile
    across chunks (threshold_tile=2)."""
    from flashmax.kernels import distributed as kernels

    rows = [0, 3, 5, 6, 7, 10, 12, 13, 14, 15]
    x = adversarial_rows(19, torch.float32)[rows]
    xt = make_input((2, 19, 3), 1, torch.float32, seed=3, kind="near_max")
    runs = ((x, [1, 18], 8, dict(chunk=8)),
            (x, [11, 8], 2, dict(chunk=8, group=2, sparse_write=1)),
            (x, [19, 0], 8, dict(chunk=4, threshold_tile=2)),
            (xt, [0, 19], 4, dict(chunk=8)),
            (adversarial_rows(19, torch.bfloat16)[rows], [9, 10], 8, dict(chunk=8)),
            (adversarial_rows(19, torch.float64)[rows], [9, 10], 2, dict(chunk=4)))
    for data, widths, ladder, launch in runs:
        x_local = my_slice(data, 1, widths)
        local = kernels.TritonShard(x_local, 1, **launch)
        y_local, _ = distributed.sharded_forward(
            x_local, 1, distributed.Collectives(WORLD), data.shape[1], local=local,
            ladder=ladder)
        try:
            check_against_oracle(whole(y_local, 1), data, 1)
        except AssertionError as error:
            raise AssertionError(f"{data.dtype} widths={widths} {launch}: {error}") from None


@case("gloo-2", "nccl-2")
def double_backward(rank, world):
    x = make_input((5, 30), 1, torch.float64, seed=8, scale=0.5)
    g = make_input((5, 30), 1, torch.float64, seed=9)
    h = make_input((5, 30), 1, torch.float64, seed=10)
    widths = [13, 17]
    x_local = my_slice(x, 1, widths).clone().requires_grad_()
    g_local = my_slice(g, 1, widths).clone().requires_grad_()
    y_local = flashmax.sparsemax(x_local, 1, group=WORLD)
    (dx,) = torch.autograd.grad(y_local, x_local, g_local, create_graph=True)
    dx.backward(my_slice(h, 1, widths))
    xw, gw = x.clone().requires_grad_(), g.clone().requires_grad_()
    (dx_ref,) = torch.autograd.grad(flashmax.sparsemax(xw, 1), xw, gw, create_graph=True)
    dx_ref.backward(h)
    torch.testing.assert_close(whole(dx, 1), dx_ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(whole(g_local.grad, 1), gw.grad, rtol=0, atol=1e-12)


@case(*ALL)
def contract_details(rank, world):
    x = make_input((6, 40), 1, torch.float32, seed=11)
    widths = splits(40, world)[1]
    x_local = my_slice(x, 1, widths)
    before = x_local.clone()
    y1 = flashmax.sparsemax(x_local, -1, group=WORLD)
    y2 = flashmax.sparsemax(x_local, -1, group=WORLD)
    assert_bitwise_equal(y1, y2, "not deterministic")
    assert_bitwise_equal(x_local, before, "the input was modified")
    assert y1.untyped_storage().data_ptr() != x_local.untyped_storage().data_ptr()
    # No rows anywhere; no features anywhere; a 0-d tensor per rank: a row of `world` entries.
    for shape in ((0, 3), (4, 0)):
        empty = torch.zeros(shape, device=DEVICE, requires_grad=True)
        y = flashmax.sparsemax(empty, 1, group=WORLD)
        assert y.shape == shape
        y.sum().backward()
    scalar = torch.tensor(float(rank) * 0.3, device=DEVICE)
    y = flashmax.sparsemax(scalar, 0, group=WORLD)
    want = oracle(torch.arange(world) * 0.3, 0)[rank]
    assert y.shape == () and abs(y.item() - want.item()) < 1e-6


@case(*ALL)
def group_of_one_and_subgroups(rank, world):
    """A group of one is the plain call, bit for bit; a subgroup splits over its own ranks."""
    singles = [dist.new_group([r]) for r in range(world)]
    pair = dist.new_group([0, 1])
    x = make_input((4, 3, 9), 1, torch.float32, seed=12, mask_p=0.3).to(DEVICE).requires_grad_()
    y = flashmax.sparsemax(x, 1, group=singles[rank])
    y.sum().backward()
    xp = x.detach().clone().requires_grad_()
    assert_bitwise_equal(y, flashmax.sparsemax(xp, 1), "group of one")
    flashmax.sparsemax(xp, 1).sum().backward()
    assert_bitwise_equal(x.grad, xp.grad, "group of one, gradient")
    if rank < 2:
        x_local = my_slice(x.detach(), 2, [4, 5])
        y_local = flashmax.sparsemax(x_local, 2, group=pair)
        pieces = [None, None]
        dist.all_gather_object(pieces, y_local.cpu(), group=pair)
        check_against_oracle(torch.cat(pieces, 2), x.detach().cpu(), 2)
    dist.barrier()


@case(*ALL)
def disagreement_is_an_error_on_every_rank(rank, world):
    """Each rank passes a different input; every rank raises, none hangs, and the next call
    still works (the ranks stay in step)."""
    whole_good = make_input((4, 6), 1, torch.float32, seed=13)
    good = whole_good.to(DEVICE)
    odd = rank == world - 1
    bad_inputs = {
        "rows": (torch.zeros((5 if odd else 4, 6), device=DEVICE), -1, ValueError),
        "dtype": (good.double() if odd else good, -1, ValueError),
        "dim": (torch.zeros(6, 6, device=DEVICE), 0 if odd else 1, ValueError),
        "shape apart from dim": (torch.zeros((3, 2, 6) if odd else (2, 3, 6), device=DEVICE), -1,
                                 ValueError),
        "gradient": (good.clone().requires_grad_(odd), -1, ValueError),
        "int dtype": (good.int() if odd else good, -1, TypeError if odd else ValueError),
        "dim out of range": (good, 5 if odd else -1, IndexError if odd else ValueError),
        "not a tensor": ([1.0] if odd else good, -1, TypeError if odd else ValueError),
    }
    for what, (x, dim, error) in bad_inputs.items():
        with pytest.raises(error) as raised:
            flashmax.sparsemax(x, dim, group=WORLD)
        if error is ValueError and what not in ("int dtype", "dim out of range", "not a tensor"):
            assert "rank 0" in str(raised.value) and f"rank {world - 1}" in str(raised.value)
        check_split(whole_good, 1, splits(6, world)[0], f"after {what}", grad=False)


def check_entmax15_split(x: torch.Tensor, dim: int, widths, what: str):
    """`check_split` for entmax-1.5: the gradient against dx = s g - (sum(s g) / sum(s)) s in
    float64 on the gathered y."""
    x_local = my_slice(x, dim, widths).requires_grad_()
    y_local = flashmax.entmax15(x_local, dim, group=WORLD)
    assert y_local.shape == x_local.shape and y_local.is_contiguous(), what
    y = whole(y_local, dim)
    g = make_input(x.shape, dim, x.dtype, seed=7)
    y_local.backward(my_slice(g, dim, widths))
    want = reference_entmax.entmax15_backward(y.double().movedim(dim, -1),
                                              g.double().movedim(dim, -1)).movedim(-1, dim)
    dx = whole(x_local.grad, dim)
    nan = want.isnan()  # NaN rows (a NaN or +inf entry, or all -inf): NaN gradients
    try:
        check_against_entmax15_oracle(y, x, dim)
        assert bool(dx[nan].isnan().all()), "a NaN row's gradient is not NaN"
        check_grad(dx[~nan], want[~nan], g, what)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


@case(*ALL)
def entmax15_every_dim_dtype_and_split(rank, world):
    halves = (torch.bfloat16,) if world == 2 else ()
    kinds = (("randn", 1), ("near_max", 3)) if world == 2 else (("ties", 2),)
    check_every_dim_dtype_and_split(check_entmax15_split, world, halves, kinds)


@case(*ALL)
def entmax15_adversarial_rows(rank, world):
    for dtype in (torch.float32, torch.float64):
        for n in (5, 64):
            x = adversarial_rows(n, dtype)
            for widths in splits(n, world):
                check_entmax15_split(x, 1, widths, f"{dtype} n={n} widths={widths}")


@case("gloo-2", "nccl-2")
def entmax15_steps_contract_and_errors(rank, world):
    """Per-row scalars only (one collective for the bound, one per step, few steps); a group
    of one is the plain call; ranks that disagree all raise; a double backward raises."""
    x = make_input((64, 1000), 1, torch.float32, seed=14)
    widths = splits(1000, world)[0]
    comm = distributed.Collectives(WORLD, trace=[])
    y_local, steps = distributed.sharded_entmax15_forward(my_slice(x, 1, widths), 1, comm)
    check_against_entmax15_oracle(whole(y_local, 1), x, 1)
    assert 1 <= steps <= 1 + math.ceil(math.log2(1000)), steps
    assert [kind for kind, _, _ in comm.trace] == ["all_gather"] * (1 + steps)
    assert all(math.prod(shape) <= 4 * world * 64 for _, shape, _ in comm.trace), comm.trace
    singles = [dist.new_group([r]) for r in range(world)]
    x_local = my_slice(x, 1, widths)
    assert_bitwise_equal(flashmax.entmax15(x_local, 1, group=singles[rank]),
                         flashmax.entmax15(x_local, 1), "group of one")
    odd = rank == world - 1
    with pytest.raises(ValueError, match=r"entmax15\(group=\.\.\.\)"):
        flashmax.entmax15(x_local.double() if odd else x_local, 1, group=WORLD)
    # With create_graph the gradient is the same; differentiating it again raises, whether the
    # incoming gradient requires one (g) or not (g.detach(), as a gradient penalty's).
    x_grad = x_local.clone().requires_grad_()
    g = my_slice(make_input((64, 1000), 1, torch.float32, seed=15), 1, widths).requires_grad_()
    (plain,) = torch.autograd.grad(flashmax.entmax15(x_grad, 1, group=WORLD), x_grad, g)
    for incoming in (g, g.detach()):
        (dx,) = torch.autograd.grad(flashmax.entmax15(x_grad, 1, group=WORLD), x_grad, incoming,
                                    create_graph=True)
        assert torch.equal(dx.detach(), plain) and bool(plain.abs().sum() > 0)
        with pytest.raises(RuntimeError, match="first-order gradients only"):
            (dx * dx).sum().backward()


@case("gloo-2")
def bench_quick(rank, world):
    """The benchmark script's --quick run inside this world; the parent reads its JSON."""
    spec = importlib.util.spec_from_file_location("distributed_bench",
                                                  ROOT / "benchmarks" / "distributed_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = os.environ["FLASHMAX_TEST_OUT"]
    args = bench.parse_args(["--quick", "--out", out, "--rows", "8", "--features", "300"])
    bench.run(args, WORLD)


# ----------------------------------------------------------------------------------------------
# The parent: one spawn per world size, one test per case
# ----------------------------------------------------------------------------------------------


def _worker(rank, backend, world, port, names, out_dir):
    global WORLD, DEVICE
    torch.set_num_threads(1)  # the ranks share the machine's cores
    os.environ["FLASHMAX_TEST_OUT"] = out_dir
    DEVICE = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    WORLD = dist.group.WORLD
    outcomes = {}
    for name in names:
        start = time.perf_counter()
        try:
            CASES[name][0](rank, world)
            outcomes[name] = {"error": None}
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
            outcomes[name] = {"error": traceback.format_exc()}
        outcomes[name]["seconds"] = time.perf_counter() - start
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(config: str, out_dir: Path) -> dict:
    """Every rank's outcomes, or a failure that names the ranks that died or hung."""
    backend, world = CONFIGS[config]
    names = [name for name, (_, configs) in CASES.items() if config in configs]
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    ranks = [context.Process(target=_worker,
                             args=(rank, backend, world, port, names, str(out_dir)))
             for rank in range(world)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + DEADLINE_S
    for process in ranks:
        process.join(max(deadline - time.monotonic(), 0))
    hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
    for process in ranks:
        if process.is_alive():
            process.terminate()
            process.join(5)
    failed = [(rank, process.exitcode) for rank, process in enumerate(ranks)
              if process.exitcode != 0]
    if hung or failed:
        return {"spawn_error": f"{config}: ranks {hung} hung past {DEADLINE_S} s; "
                               f"(rank, exit code) {failed}"}
    return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)}


_RUNS = {}


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
    def run(config):
        if config not in _RUNS:
            out_dir = tmp_path_factory.mktemp(config)
            _RUNS[config] = (_spawn(config, out_dir), out_dir)
        return _RUNS[config]

    return run


@pytest.mark.parametrize("config,name", [(config, name) for name, (_, configs) in CASES.items()
                                         for config in configs])
def test_case(run_config, config, name):
    outcomes, out_dir = run_config(config)
    assert "spawn_error" not in outcomes, outcomes.get("spawn_error")
    errors = {rank: ranks[name]["error"] for rank, ranks in outcomes.items()
              if ranks[name]["error"]}
    assert not errors, "\n".join(f"rank {rank}:\n{error}" for rank, error in errors.items())
    if name == "bench_quick":
        record = json.loads((out_dir / "distributed.json").read_text())
        assert record["world"] == 2 and record["backend"] == "gloo"
        assert (record["rows"], record["features"], record["widths"]) == (8, 300, [150, 150])
        assert record["max_abs_diff_vs_whole_rows"] < 1e-6
        assert record["relative_error_vs_fp64_oracle"] < 1e-6
        assert record["max_row_sum_error"] < 1e-5
        assert 3 <= record["forward_collectives"] == 2 + record["newton_steps"]
        assert 0 < record["forward_collectives_share"] and record["sharded_forward_ms"] > 0


def test_step_cap():
    """The hard cap: the bracket halves per step down to the float resolution of tau."""
    assert distributed.max_steps(1024, torch.float32) == 10 + 23 + 3  # eps = 2^-23
    assert distributed.max_steps(1, torch.float64) == 52 + 3


def _poison_stored_chunks(shard, dim: int) -> int:
    """NaN over the chunks of the kernels' own input whose candidates are stored (and few
    enough to be written from the output alone): passes after the first must not read them.
    Returns how many."""
    from flashmax.kernels.sparsemax import PART_COUNT, PART_SIZE

    split = shard.split
    x = split.x.movedim(dim, -1)
    counts = split.part.view(split.n_rows, -1, PART_SIZE.value)[..., PART_COUNT.value].cpu()
    poisoned = 0
    for row, chunk in (counts <= split.sparse).nonzero().tolist():
        start = chunk * split.chunk
        length = min(split.n - start, split.chunk)
        if 2 * counts[row, chunk] <= length:
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(row), x.shape[:-1]))
            x[index][start:start + length] = math.nan
            poisoned += 1
    return poisoned


@pytest.mark.parametrize("launch", [dict(chunk=8), dict(chunk=8, group=2, sparse_write=1),
                                    dict(chunk=4, threshold_tile=2)],
                         ids=["chunks", "group-maxima-rereading", "row-tile-across-chunks"])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_triton_local_work_matches_torch(dim, launch):
    """Each local pass of the CUDA path (Triton: under the interpreter, or compiled with
    FLASHMAX_TEST_DEVICE=cuda) against the torch path, on a strided view with NaN, +inf, -inf
    and tied rows and a good row with a whole chunk of -inf; the input of the chunks whose
    candidates are stored is poisoned after the first pass, which alone may read it."""
    from flashmax.kernels import distributed as kernels

    def on(t):
        return t.to(KERNEL_DEVICE)

    shape = [2, 3, 4]
    shape[dim] = 19
    x = make_input(shape, dim, torch.float32, seed=dim, scale=0.4).transpose(0, 2)
    dim = 2 - dim
    rows = x.movedim(dim, -1)
    rows[0, 0, 3], rows[1, 1, 0], rows[0, 1] = math.nan, math.inf, -math.inf
    rows[1, 0], rows[2, 0, :8] = 2.5, -math.inf
    on_torch = distributed.TorchShard(x, dim)
    on_triton = kernels.TritonShard(on(x.clone()), dim, **launch)
    summary = on_torch.summary()
    summary_triton = on_triton.summary().cpu()
    assert_bitwise_equal(summary_triton[0], summary[0], "slice max")
    # The slice's exact tau, by a sort (torch) and by Newton over the candidates (Triton).
    torch.testing.assert_close(summary_triton[1], summary[1], rtol=1e-6, atol=1e-7)
    assert _poison_stored_chunks(on_triton, dim) > 0
    row_max, bound = distributed.combine(summary[None])
    good = torch.isfinite(row_max)
    # Points at or above the slice's tau, as the driver's are (the candidates hold no less).
    taus = torch.stack([bound, bound / 2]).clamp_min(-1).masked_fill(~good, math.nan)
    centre = torch.full_like(bound, 0.2)
    torch.testing.assert_close(on_triton.sums(on(row_max), on(taus), on(centre)).cpu()[..., good],
                               on_torch.sums(row_max, taus, centre)[..., good], rtol=1e-6,
                               atol=1e-6)
    step = torch.full_like(bound, 0.01)
    y_triton = on_triton.write(on(row_max), on(bound), on(step)).cpu()
    y = on_torch.write(row_max, bound, step)
    torch.testing.assert_close(y_triton, y, equal_nan=True)
    y = y.nan_to_num(0.5)
    g = make_input(y.shape, dim, torch.float32, seed=5).transpose(0, 1).contiguous().transpose(0, 1)
    sums = kernels.support_sums(on(y), on(g), dim, chunk=8).cpu()
    torch.testing.assert_close(sums, distributed.torch_support_sums(y, g, dim), atol=1e-6, rtol=0)
    mean = sums[0] / sums[1]
    torch.testing.assert_close(kernels.backward_write(on(y), on(g), on(mean), dim, chunk=8).cpu(),
                               distributed.torch_backward_write(y, g, mean, dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ladder", [2, 8])
def test_triton_ladder_update_matches_torch(ladder, dtype):
    """The CUDA path's one-launch update against the torch ops it replaces, bit for bit, on
    three ranks' sums with done rows, rows whose lower bounds end at each point of the ladder
    (and one whose f breaks monotonicity by rounding), a row whose bracket is closed, and more
    rows than one program holds."""
    from flashmax.kernels import distributed as kernels

    rows, world = 1030, 3
    generator = torch.Generator().manual_seed(ladder)
    pivot = -torch.rand(rows, generator=generator, dtype=torch.float64).to(dtype)
    step = torch.rand(rows, generator=generator, dtype=torch.float64).to(dtype) / 100
    hi = (pivot + step + torch.rand(rows, generator=generator, dtype=torch.float64) / 10).to(dtype)
    done = torch.rand(rows, generator=generator) < 0.2
    # A row whose bracket is closed, but whose Newton step alone would not end it.
    hi[7], done[7] = pivot[7] + step[7], False
    points = distributed.next_points(pivot, step, hi, done, ladder)
    # Sums of f descending along the ladder, each row's lower bounds ending at a random point.
    ends = torch.randint(0, ladder, (rows,), generator=generator)
    total = torch.where(torch.arange(ladder)[:, None] <= ends, 1.5, 0.5).double()
    total = total - torch.rand((ladder, rows), generator=generator, dtype=torch.float64) / 4
    total[ladder - 1, 11], ends[11] = 1.2, 0  # f >= 0 again after f < 0: not a lower bound
    total[1:, 11] = torch.where(torch.arange(1, ladder) < ladder - 1, 0.9, 1.2).double()
    parts = torch.rand((world, ladder, rows), generator=generator, dtype=torch.float64)
    everyone = torch.stack([total * parts / parts.sum(0),
                            torch.randint(1, 50, (world, ladder, rows), generator=generator).double(),
                            torch.rand((world, ladder, rows), generator=generator,
                                       dtype=torch.float64) / 40], 2)
    everyone[:, :, :, 7] = torch.tensor([0.5, 5.0, 0.0], dtype=torch.float64)
    everyone[:, :, 1, :2] = 0  # rows with an empty support at every point
    on_torch = distributed.TorchShard.advance(everyone, points, pivot, step, done, hi)
    state = [t.clone().to(KERNEL_DEVICE) for t in (pivot, step, done, hi)]
    on_triton = kernels.TritonShard.advance(everyone.to(KERNEL_DEVICE), points.to(KERNEL_DEVICE),
                                            *state)
    names = ("pivot", "step", "done", "hi", "centre", "next points")
    for name, expected, got in zip(names, on_torch, on_triton):
        assert_bitwise_equal(got.cpu(), expected, name)
    assert bool(on_torch[2][7]), "no float between tau and hi: the row ends"
    # Rows whose lower bounds go past the Newton point start from a higher point.
    moved = ~done & (ends > 0)
    assert bool((on_torch[0][moved] >= (pivot + step)[moved]).all())
    assert bool((on_torch[0][moved] > (pivot + step)[moved]).float().mean() > 0.9)
