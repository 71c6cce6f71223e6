"""`flashmax bench` on the CPU with tiny workloads: the harness's logic, never its timings."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

import flashmax
from flashmax.bench import cli, peers, report, runner, timing
from flashmax.bench.runner import Record, Settings
from flashmax.bench.workloads import (CPU_SWEEP_MAX_FEATURES, CPU_SWEEP_MIN_BYTES, DISTRIBUTIONS, DTYPES,
                                      GPU_SWEEP_MIN_BYTES, SWEEP_FEATURES, SWEEP_QUICK_FEATURES, Workload,
                                      sweep_tokens)

TINY = ["bench", "--device", "cpu", "--tokens", "4", "--features", "16", "32", "--quick"]
TIMES = ("median_us", "p20_us", "p80_us", "floor_us", "ratio_to_floor", "gbps")


def run(tmp_path, *options: str) -> dict:
    assert cli.main([*TINY, *options, "--out", str(tmp_path)]) == 0
    return json.loads((tmp_path / "bench.json").read_text())


def test_cli_parses_every_option():
    args = cli.build_parser().parse_args(
        ["bench", "--dtype", "fp32", "bf16", "fp16", "--features", "16", "32", "--tokens", "4",
         "--modes", "forward", "backward", "full", "eager", "--dist", "randn0.01", "--impls", "flashmax", "entmax",
         "--out", "somewhere", "--quick", "--device", "cpu"])
    assert args.dtypes == ["fp32", "bf16", "fp16"] and args.features == [16, 32] and args.tokens == 4
    assert args.modes == ["forward", "backward", "full", "eager"] and args.dist == "randn0.01"
    assert args.impls == ["flashmax", "entmax"] and str(args.out) == "somewhere" and args.quick
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--impls", "no-such-impl"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--features", "0"])


def test_python_m_flashmax_bench_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "flashmax.bench", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--features" in done.stdout


def test_records_are_complete_and_files_written(tmp_path):
    data = run(tmp_path, "--dtype", "fp32", "bf16", "--modes", "forward", "backward", "full")
    runnable = [impl for impl in peers.discover(torch.device("cpu")) if impl.available]
    assert {"flashmax", "torch-sort"} <= {impl.name for impl in runnable}
    records = data["records"]
    assert len(records) == 2 * 2 * 3 * len(runnable)  # dtypes x features x modes x impls
    fields = {field.name for field in dataclasses.fields(Record)}
    for record in records:
        assert set(record) == fields
        assert record["error"] is None, record
        for key in (*TIMES, "rel_error"):
            assert math.isfinite(record[key]) and record[key] >= 0, (key, record)
        assert record["floor_us"] > 0
        assert record["graph_us"] is None and record["peak_mb"] is None  # GPU-only numbers
        assert record["device"] == "CPU" and record["flashmax_commit"] and record["date"]
        if record["impl"] in ("flashmax", "torch-sort"):
            assert record["inexact"] is False, record
    not_run = {entry["impl"]: entry["reason"] for entry in data["not_run"]}
    assert not_run["torch-sort-compiled"].startswith("skipped on CPU")
    assert set(not_run) | {impl.name for impl in runnable} == set(peers.NAMES)
    markdown = (tmp_path / "bench.md").read_text()
    assert "## fp32 forward" in markdown and "## bf16 full" in markdown and "| 32 |" in markdown
    for mode in ("forward", "backward", "full"):
        assert (tmp_path / f"bench-{mode}.png").read_bytes().startswith(b"\x89PNG")


def test_missing_peers_are_reported_not_installed(tmp_path, monkeypatch, capsys):
    real_version = peers.package_version
    monkeypatch.setattr(peers, "package_version", lambda name: None if name == "entmax" else real_version(name))
    monkeypatch.setattr(report, "Console", None)  # and the plain-print fallback for a missing rich
    data = run(tmp_path, "--impls", "flashmax", "entmax", "liger", "adasplash")
    not_run = {entry["impl"]: entry["reason"] for entry in data["not_run"]}
    assert not_run["entmax"] == "not installed"
    assert not_run["liger"] in ("not installed", "needs a GPU")
    assert not_run["adasplash"] in ("not installed", "needs a GPU")
    assert {record["impl"] for record in data["records"]} == {"flashmax"}
    printed = capsys.readouterr().out
    assert "not run: entmax: not installed" in printed and "floor (clone)" in printed


def test_inexact_and_failing_impls_are_flagged_not_raised(tmp_path, monkeypatch):
    def broken(x, dim):
        raise RuntimeError("kernel exploded")

    fakes = (peers.PEERS[0],
             peers.Peer("softmax", "torch", lambda: torch.softmax),
             peers.Peer("broken", "torch", lambda: broken))
    monkeypatch.setattr(peers, "PEERS", fakes)
    records = run(tmp_path, "--modes", "forward", "full")["records"]
    by_impl = {impl: [r for r in records if r["impl"] == impl] for impl in ("flashmax", "softmax", "broken")}
    assert all(r["inexact"] is False for r in by_impl["flashmax"])
    assert all(r["inexact"] is True for r in by_impl["softmax"])
    assert all(r["error"] == "RuntimeError: kernel exploded" and r["median_us"] is None
               for r in by_impl["broken"])


def test_alternating_timing_runs_op_and_reference_in_turn():
    calls = []
    ours, theirs = timing.measure_alternating(lambda: calls.append("op"), lambda: calls.append("reference"),
                                              torch.device("cpu"), timing.Budget(gpu_ms=1, cpu_runs=7))
    assert calls == ["op", "reference"] * (1 + 1 + 7)  # the first calls, the warm-up, the timed runs
    assert 0 < ours.p20_us <= ours.median_us <= ours.p80_us and 0 < theirs.median_us


@pytest.mark.parametrize("op", ["sparsemax", "sparsemax_loss"])
def test_eager_mode_is_divided_by_pytorchs_own_op_timed_in_turn(tmp_path, monkeypatch, op):
    """Mode eager's floor is torch.softmax (cross_entropy for a loss), forward + backward on the same input,
    timed with each implementation, not the clone."""
    references, reference_us = [], []
    real_measure = runner.measure_alternating

    def spy(op_, reference, device, budget):
        references.append(reference())
        ours, theirs = real_measure(op_, reference, device, budget)
        reference_us.append(theirs.median_us)
        return ours, theirs

    monkeypatch.setattr(runner, "measure_alternating", spy)
    records = run(tmp_path, "--op", op, "--modes", "forward", "eager", "--impls", "flashmax")["records"]
    eager = [r for r in records if r["mode"] == "eager"]
    assert len(eager) == 2 and len(references) == 2  # features
    for record, (y, dx), floor_us in zip(eager, references, reference_us):
        assert record["error"] is None and record["inexact"] is False, record
        assert record["floor_us"] == floor_us
        assert record["ratio_to_floor"] == pytest.approx(record["median_us"] / record["floor_us"])
        assert record["graph_us"] is None and record["datasheet_floor_us"] is None
        workload = Workload(tokens=4, features=record["features"], dtype="fp32", dist="randn")
        x = workload.input(torch.device("cpu"))
        if op == "sparsemax":
            torch.testing.assert_close(y, torch.softmax(x, -1))
        else:
            torch.testing.assert_close(y, torch.nn.functional.cross_entropy(
                x, workload.target(torch.device("cpu")), reduction="none"))
        assert dx.shape == x.shape and dx.count_nonzero() > 0
    markdown = (tmp_path / "bench.md").read_text()
    assert "## fp32 eager" in markdown
    assert ("`torch.softmax` forward + backward" if op == "sparsemax" else "`torch cross_entropy`") in markdown


def test_eager_mode_is_refused_in_a_sweep():
    with pytest.raises(SystemExit):
        sweep_settings("--device", "cpu", "--modes", "eager")


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_inputs_are_reproducible_fresh_and_not_zero(dist):
    workload = Workload(tokens=4, features=16, dtype="bf16", dist=dist)
    x, again = workload.input(torch.device("cpu")), workload.input(torch.device("cpu"))
    assert torch.equal(x, again) and x.data_ptr() != again.data_ptr()
    assert x.dtype == torch.bfloat16 and x.shape == (4, 16) and x.count_nonzero() > 0
    assert not torch.equal(workload.grad(torch.device("cpu")), x)


def sweep_settings(*options: str) -> Settings:
    parser = cli.build_parser()
    return cli.settings_from_args(parser.parse_args(["bench", "--sweep", *options]), parser)


def test_sweep_widths_and_rows_fill_the_size():
    assert list(SWEEP_FEATURES) == sorted({2**k for k in range(3, 21)}
                                          | {10, 100, 1000, 50257, 128256, 151936, 262144})
    settings = dataclasses.replace(sweep_settings("--device", "cpu"), features=SWEEP_FEATURES,
                                   sweep_min_bytes=GPU_SWEEP_MIN_BYTES)  # the GPU's sweep, built on any machine
    workloads = settings.workloads()
    assert [(w.dtype, w.features) for w in workloads] == [(d, f) for d in ("fp32", "bf16") for f in SWEEP_FEATURES]
    for w in workloads:
        row_bytes = w.features * DTYPES[w.dtype].itemsize
        assert GPU_SWEEP_MIN_BYTES <= w.tokens * row_bytes < GPU_SWEEP_MIN_BYTES + row_bytes, w  # the fewest rows
        assert w.tokens == sweep_tokens(w.features, w.dtype, GPU_SWEEP_MIN_BYTES)
    for dtype in ("fp32", "bf16"):  # each width its own rows: the wider, the fewer
        tokens = [w.tokens for w in workloads if w.dtype == dtype]
        assert tokens == sorted(set(tokens), reverse=True)


def test_sweep_defaults_on_a_cpu(capsys):
    settings = sweep_settings("--device", "cpu")
    assert "sweeping on a smaller scale" in capsys.readouterr().out
    assert list(settings.features) == [f for f in SWEEP_FEATURES if f <= CPU_SWEEP_MAX_FEATURES]
    assert 1000 in settings.features and settings.features[0] == 8 and settings.features[-1] == 4096
    assert settings.sweep_min_bytes == CPU_SWEEP_MIN_BYTES and settings.tokens is None
    assert list(settings.dtypes) == ["fp32", "bf16"] and list(settings.modes) == ["forward", "backward"]
    assert list(settings.requested_impls) == ["flashmax"]
    quick = sweep_settings("--device", "cpu", "--quick", "--dtype", "fp16", "--impls", "torch-sort")
    assert set(quick.features) < set(settings.features) and list(quick.dtypes) == ["fp16"]
    assert list(quick.requested_impls) == ["torch-sort"]
    with pytest.raises(SystemExit):
        sweep_settings("--device", "cpu", "--tokens", "4")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--device", "cpu", "--min-bytes", "4096"])


def test_sweep_runs_end_to_end(tmp_path):
    assert cli.main(["bench", "--sweep", "--quick", "--device", "cpu", "--min-bytes", "4096",
                     "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "bench.json").read_text())["records"]
    widths = [f for f in SWEEP_QUICK_FEATURES if f <= CPU_SWEEP_MAX_FEATURES]
    assert sorted((r["dtype"], r["features"], r["mode"]) for r in records) == sorted(
        (d, f, m) for d in ("fp32", "bf16") for f in widths for m in ("forward", "backward"))
    for record in records:
        assert record["impl"] == "flashmax" and record["error"] is None and record["inexact"] is False
        assert record["tokens"] == sweep_tokens(record["features"], record["dtype"], 4096)
    assert len({r["tokens"] for r in records}) > 1
    assert (tmp_path / "bench-sweep.png").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "bench-forward.png").exists()
    assert f"| 8 | {sweep_tokens(8, 'bf16', 4096)} |" in (tmp_path / "bench.md").read_text()


def test_entmax15_op_runs_its_peers_against_its_oracle(tmp_path):
    data = run(tmp_path, "--op", "entmax15", "--modes", "forward", "backward")
    records = data["records"]
    assert {record["op"] for record in records} == {"entmax15"}
    runnable = [impl.name for impl in peers.discover(torch.device("cpu"), op="entmax15") if impl.available]
    assert {"flashmax", "torch-sort"} <= set(runnable) and "liger" not in runnable
    assert len(records) == 2 * 2 * len(runnable)  # features x modes x impls
    for record in records:
        assert record["error"] is None, record
        if record["impl"] in ("flashmax", "torch-sort", "entmax"):
            assert record["inexact"] is False, record
    assert (tmp_path / "bench.md").read_text().startswith("# flashmax bench: entmax15")


@pytest.mark.parametrize("op", ["sparsemax", "entmax15"])
def test_columns_layout_reduces_a_dim_that_is_not_the_last(tmp_path, op):
    workload = Workload(4, 16, "fp32", "randn", "columns")
    assert workload.input(torch.device("cpu")).shape == (16, 4) and workload.dim == 0
    data = run(tmp_path, "--op", op, "--layout", "columns", "--modes", "forward", "backward", "full")
    records = data["records"]
    assert records and {record["layout"] for record in records} == {"columns"}
    for record in records:
        assert record["error"] is None, record
        if record["impl"] in ("flashmax", "torch-sort", "entmax"):
            assert record["inexact"] is False, record
    assert "features × tokens, over dim 0" in (tmp_path / "bench.md").read_text()
    with pytest.raises(SystemExit):
        cli.main(["bench", "--op", "sparsemax_loss", "--layout", "columns", "--device", "cpu"])


def test_entmax15_oracle_is_not_sparsemax():
    """Each op's records are checked against its own oracle: sparsemax is inexact as entmax15."""
    workload = Workload(tokens=4, features=16, dtype="fp32", dist="randn")
    x = workload.input(torch.device("cpu"))
    oracle = runner.Oracle(workload, torch.device("cpu"), "entmax15")
    assert oracle.error("forward", flashmax.entmax15(x)) < 1e-6
    assert oracle.error("forward", flashmax.sparsemax(x)) > 1e-2


def test_entmax_bisect_op_runs_at_its_alpha(tmp_path):
    data = run(tmp_path, "--op", "entmax_bisect", "--alpha", "1.25", "--modes", "forward", "backward")
    records = data["records"]
    assert {(record["op"], record["alpha"]) for record in records} == {("entmax_bisect", 1.25)}
    runnable = [impl.name for impl in peers.discover(torch.device("cpu"), op="entmax_bisect") if impl.available]
    assert "flashmax" in runnable and "torch-sort" not in runnable and "liger" not in runnable
    assert len(records) == 2 * 2 * len(runnable)  # features x modes x impls
    for record in records:
        assert record["error"] is None, record
        if record["impl"] in ("flashmax", "entmax-bisect"):
            assert record["inexact"] is False, record
    assert (tmp_path / "bench.md").read_text().startswith("# flashmax bench: entmax_bisect (α = 1.25)")
    parser = cli.build_parser()
    for wrong in (["--alpha", "1"], ["--alpha", "inf"], ["--op", "entmax15", "--alpha", "1.5"]):
        with pytest.raises(SystemExit):
            cli.settings_from_args(parser.parse_args(["bench", "--device", "cpu", *wrong]), parser)


def test_entmax_bisect_oracle_and_impls_take_alpha():
    """The α given reaches the oracle (forward and gradient) and every implementation."""
    workload = Workload(tokens=4, features=16, dtype="fp32", dist="randn")
    x, g = workload.input(torch.device("cpu")), workload.grad(torch.device("cpu"))
    oracle = runner.Oracle(workload, torch.device("cpu"), "entmax_bisect", 1.25)
    assert oracle.error("forward", flashmax.entmax_bisect(x, 1.25)) < 1e-6
    assert oracle.error("forward", flashmax.entmax_bisect(x, 1.5)) > 1e-2
    xg = x.clone().requires_grad_()
    dx = torch.autograd.grad(flashmax.entmax_bisect(xg, 1.25), xg, g)[0]
    assert oracle.error("backward", dx) < 1e-5
    flashmax_impl = peers.discover(torch.device("cpu"), ["flashmax"], "entmax_bisect", 1.25)[0]
    assert torch.equal(flashmax_impl.fn(x, -1), flashmax.entmax_bisect(x, 1.25))


@pytest.mark.parametrize("op", ["sparsemax_loss", "entmax15_loss"])
def test_loss_ops_run_their_peers_against_their_oracle(tmp_path, op):
    data = run(tmp_path, "--op", op, "--modes", "forward", "backward", "full")
    records = data["records"]
    runnable = [impl.name for impl in peers.discover(torch.device("cpu"), op=op) if impl.available]
    assert {"flashmax", "torch-sort"} <= set(runnable) and "liger" not in runnable
    assert len(records) == 2 * 3 * len(runnable)  # features x modes x impls
    for record in records:
        assert record["op"] == op and record["error"] is None, record
        if record["impl"] in ("flashmax", "torch-sort"):
            assert record["inexact"] is False, record
    # The floor scales to the tensors each mode moves: 1 (x), 2 (x, dx), 3 (x twice, dx).
    floors = {(r["features"], r["mode"]): r["floor_us"] for r in records}
    for features in (16, 32):
        assert floors[features, "backward"] == pytest.approx(2 * floors[features, "forward"])
        assert floors[features, "full"] == pytest.approx(3 * floors[features, "forward"])
    assert "(forward 1, backward 2, full 3)" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("entmax15", [False, True])
def test_loss_oracle_is_the_loss_and_its_gradient(entmax15):
    """The oracle matches the public loss and its gradient, and a wrong target is far from it."""
    op = "entmax15_loss" if entmax15 else "sparsemax_loss"
    workload = Workload(tokens=6, features=16, dtype="fp32", dist="randn")
    cpu = torch.device("cpu")
    x, target, g = workload.input(cpu), workload.target(cpu), workload.loss_grad(cpu)
    oracle = runner.Oracle(workload, cpu, op)
    loss_fn = flashmax.entmax15_loss if entmax15 else flashmax.sparsemax_loss
    xg = x.clone().requires_grad_()
    loss = loss_fn(xg, target)
    assert oracle.error("forward", loss) < 1e-6
    assert oracle.error("forward", loss_fn(x, (target + 1) % 16)) > 1e-2
    assert oracle.error("backward", torch.autograd.grad(loss, xg, g)[0]) < 1e-6
