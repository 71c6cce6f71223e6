"""`flashmax bench` on the CPU with tiny workloads: the harness's logic, never its timings."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

from flashmax.bench import cli, peers, report
from flashmax.bench.runner import Record
from flashmax.bench.workloads import DISTRIBUTIONS, Workload

TINY = ["bench", "--device", "cpu", "--tokens", "4", "--features", "16", "32", "--quick"]
TIMES = ("median_us", "p20_us", "p80_us", "floor_us", "ratio_to_floor", "gbps")


def run(tmp_path, *options: str) -> dict:
    assert cli.main([*TINY, *options, "--out", str(tmp_path)]) == 0
    return json.loads((tmp_path / "bench.json").read_text())


def test_cli_parses_every_option():
    args = cli.build_parser().parse_args(
        ["bench", "--dtype", "fp32", "bf16", "fp16", "--features", "16", "32", "--tokens", "4",
         "--modes", "forward", "backward", "full", "--dist", "randn0.01", "--impls", "flashmax", "entmax",
         "--out", "somewhere", "--quick", "--device", "cpu"])
    assert args.dtypes == ["fp32", "bf16", "fp16"] and args.features == [16, 32] and args.tokens == 4
    assert args.modes == ["forward", "backward", "full"] and args.dist == "randn0.01"
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


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_inputs_are_reproducible_fresh_and_not_zero(dist):
    workload = Workload(tokens=4, features=16, dtype="bf16", dist=dist)
    x, again = workload.input(torch.device("cpu")), workload.input(torch.device("cpu"))
    assert torch.equal(x, again) and x.data_ptr() != again.data_ptr()
    assert x.dtype == torch.bfloat16 and x.shape == (4, 16) and x.count_nonzero() > 0
    assert not torch.equal(workload.grad(torch.device("cpu")), x)
