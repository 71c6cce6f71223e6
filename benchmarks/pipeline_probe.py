"""Memory probe for a persistent, software-pipelined forward: can one program a SM that loops
over rows, with Triton's pipeliner staging the next row in shared memory (cp.async) while it
searches this one, hide the search behind the memory traffic where today's one-program-a-row
kernel holds a SM idle during it (bf16 from 16384 entries: one program a SM, NOTES v53)?

The pipeliner stages a loop's loads only in an innermost loop (a `while` inside the body, such
as the Newton search's, turns it off; statically unrolled steps under `if` keep it: checked on
the TTGIR of triton 3.6, sm_90a). So the stand-in search here is STEPS unrolled full-row
Newton steps (sum and count in one reduction each), each skipped once the row's tau stops
moving, and the output max(z - tau, 0), z = x - max: the traffic of a forward and at least the
block-wide reductions of one (today's randn rows take ~2 group steps and a count).

    held       one program a row (grid = rows), no staging: today's kernels' memory pattern
    piped-S-P  P programs a SM looping over rows, the pipeliner's S stages
    python benchmarks/pipeline_probe.py    (writes $OUT/pipeline-probe.json when OUT is set)

Times against x.clone() of the same inputs, and flashmax's forward, in one run.
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from kernel_variants import cold_inputs, gpu_time_us, make  # noqa: E402

import flashmax  # noqa: E402
from flashmax.kernels.sparsemax import _add_add  # noqa: E402


@triton.jit
def piped_rows_kernel(X, Y, n_rows, n, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                      STEPS: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0), num_stages=STAGES):
        offsets = row.to(tl.int64) * n + cols
        z = tl.load(X + offsets).to(tl.float32)
        z = z - tl.max(z, axis=0)
        tau = -1.0
        done = False
        for _ in tl.static_range(STEPS):
            if not done:
                support = z > tau
                total, count = tl.reduce((tl.where(support, z, 0.0), support.to(tl.float32)), 0,
                                         _add_add)
                new_tau = (total - 1.0) / count
                done = new_tau == tau
                tau = new_tau
        tl.store(Y + offsets, tl.maximum(z - tau, 0.0).to(Y.dtype.element_ty))


def launch(x, stages, steps, programs_per_sm, warps):
    rows, n = x.shape
    y = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = rows if programs_per_sm == 0 else min(rows, sms * programs_per_sm)
    piped_rows_kernel[(grid,)](x, y, rows, n, BLOCK_N=n, STAGES=stages, STEPS=steps,
                               num_warps=warps)
    return y


def main():
    records = []
    rows = 2048
    for dtype in (torch.bfloat16, torch.float32):
        for n in (4096, 8192, 16384, 32768):
            warps = max(4, min(16, n // 2048))
            inputs = [make("randn", rows, n, dtype, seed)
                      for seed in range(cold_inputs(rows, n, dtype.itemsize))]
            floor = gpu_time_us(lambda x: x.clone(), inputs)[0]
            arms = {"flashmax": lambda x: flashmax.sparsemax(x)}
            for steps in (0, 2, 4):
                arms[f"held-s{steps}"] = lambda x, s=steps: launch(x, 1, s, 0, warps)
                for stages, per_sm in ((2, 1), (2, 2), (3, 1)):
                    if (stages - 1) * n * dtype.itemsize > 200 * 1024:
                        continue  # the staged rows would not fit a SM's shared memory
                    arms[f"piped{stages}-p{per_sm}-s{steps}"] = (
                        lambda x, st=stages, s=steps, p=per_sm: launch(x, st, s, p, warps))
            for name, fn in arms.items():
                try:
                    y = fn(inputs[0])
                    want = inputs[0].float()
                    if name.endswith("-s0"):  # no search: tau = -1 below the max
                        want = torch.clamp(want - want.amax(1, keepdim=True) + 1.0, min=0.0)
                        err = (y.float() - want).abs().max().item()
                    else:
                        err = None
                    us = gpu_time_us(fn, inputs)[0]
                except Exception as error:  # an arm that does not compile: say so, go on
                    print(f"{name} {n} {dtype}: {type(error).__name__}: {str(error)[:200]}",
                          flush=True)
                    continue
                record = dict(dtype=str(dtype), n=n, rows=rows, arm=name, warps=warps,
                              median_us=us, clone_us=floor, ratio=us / floor, max_abs_error=err)
                records.append(record)
                print(json.dumps(record), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "pipeline-probe.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, records=records), f, indent=1)
    print(f"{'dtype':<15}{'n':>6}  " + "  ".join(sorted({r['arm'] for r in records})))
    for dtype in sorted({r["dtype"] for r in records}):
        for n in sorted({r["n"] for r in records}):
            cells = {r["arm"]: r["ratio"] for r in records if r["dtype"] == dtype and r["n"] == n}
            print(f"{dtype:<15}{n:>6}  " + "  ".join(f"{a}={cells[a]:.2f}" for a in sorted(cells)))


if __name__ == "__main__":
    main()
