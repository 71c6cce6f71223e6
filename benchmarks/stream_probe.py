"""Memory probe for a streamed one-program-a-row forward (NOTES, v52): can a program read its
row from HBM in chunks (keeping only the running elementwise maxima, the group maxima of
today's kernels), run a few block-wide reductions over them, then read the row again from L2
and write it, at copy speed? Times, against x.clone() of the same inputs, kernels that do that
traffic with a stand-in search (STEPS Newton steps on the group maxima) and write x - max:

    held     the row in registers, one read and one write (the memory pattern of today's kernel)
    stream   chunk loop: maxima; STEPS steps; chunk loop again: read, write
    python benchmarks/stream_probe.py          (writes $OUT/stream-probe.json when OUT is set)

Only the STEPS = 0 rows measure what they say (`results/kernel-variants/v52-stream-probe.json`):
with STEPS = 4 every variant took 0.2-7 ms whatever the width, ~100x a step's expected cost,
so the stand-in search (Newton on a [1, CHUNK] tile) compiled to something else; not
investigated.
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from kernel_variants import cold_inputs, gpu_time_us, make  # noqa: E402

from flashmax.kernels import sparsemax as kernels  # noqa: E402


@triton.jit
def _steps(group_z, STEPS: tl.constexpr):
    """STEPS Newton steps on the group maxima in x - max (a stand-in for the search)."""
    tau = tl.full([1], -1.0, tl.float32)
    for _ in tl.static_range(STEPS):
        d = group_z[None, :] - tau[:, None]
        total = tl.sum(tl.where(d > 0, d, 0.0), axis=1)
        count = tl.sum((d > 0).to(tl.float32), axis=1)
        tau = tau + (total - 1.0) / count
    return tau


@triton.jit
def held_kernel(X, Y, n_rows, n, BLOCK_N: tl.constexpr, STEPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x = tl.load(X + row * n + cols, mask=cols < n, other=-float("inf")).to(tl.float32)
    row_max = tl.max(x, axis=0)
    tau = _steps(x - row_max, STEPS)
    y = tl.maximum(x - row_max - tl.sum(tau, axis=0) * 0.0, -1.0)
    tl.store(Y + row * n + cols, y.to(Y.dtype.element_ty), mask=cols < n)


@triton.jit
def stream_kernel(X, Y, n_rows, n, CHUNK: tl.constexpr, STEPS: tl.constexpr):
    cols = tl.arange(0, CHUNK)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        base = row * n  # the probe's tensors stay below 2**31 entries
        group_max = tl.full([CHUNK], -float("inf"), tl.float32)
        for start in tl.range(0, n, CHUNK):
            x = tl.load(X + base + start + cols, mask=start + cols < n, other=-float("inf"))
            group_max = tl.maximum(group_max, x.to(tl.float32))
        row_max = tl.max(group_max, axis=0)
        shift = row_max + tl.sum(_steps(group_max - row_max, STEPS), axis=0) * 0.0
        for start in tl.range(0, n, CHUNK):
            x = tl.load(X + base + start + cols, mask=start + cols < n, other=0.0)
            y = tl.maximum(x.to(tl.float32) - shift, -1.0)
            tl.store(Y + base + start + cols, y.to(Y.dtype.element_ty), mask=start + cols < n)


def held(x, steps):
    y = torch.empty_like(x)
    rows, n = x.shape
    block = triton.next_power_of_2(n)
    warps = kernels.rows_launch(x, rows, n).num_warps
    held_kernel[(rows,)](x, y, rows, n, BLOCK_N=block, STEPS=steps, num_warps=warps)
    return y


def stream(x, steps, chunk, warps, per_sm):
    y = torch.empty_like(x)
    rows, n = x.shape
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = min(rows, per_sm * sms) if per_sm else rows
    stream_kernel[(programs,)](x, y, rows, n, CHUNK=chunk, STEPS=steps, num_warps=warps)
    return y


def main():
    rows = 2048
    variants = {"held": lambda x, s: held(x, s)}
    for chunk, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8)):
        for per_sm in (0, 2, 4, 8):
            variants[f"stream{chunk}w{warps}p{per_sm}"] = (
                lambda x, s, c=chunk, w=warps, p=per_sm: stream(x, s, c, w, p))
    records = []
    for dtype, widths in ((torch.bfloat16, (8192, 16384, 32768)), (torch.float32, (16384, 32768))):
        for n in widths:
            inputs = [make("randn", rows, n, dtype, seed) for seed in range(
                cold_inputs(rows, n, dtype.itemsize))]
            floor = gpu_time_us(lambda x: x.clone(), inputs)[0]
            today = gpu_time_us(lambda x: kernels.sparsemax_forward(x, 1), inputs)[0]
            records.append(dict(variant="flashmax", steps=None, n=n, dtype=str(dtype)[6:],
                                us=today, ratio=today / floor))
            want = inputs[0].float() - inputs[0].float().amax(1, keepdim=True)
            for steps in (0, 4):
                for name, fn in variants.items():
                    got = fn(inputs[0], steps)
                    ok = torch.equal(got.float(), want.clamp_min(-1.0).to(dtype).float())
                    med = gpu_time_us(lambda x: fn(x, steps), inputs)[0]
                    records.append(dict(variant=name, steps=steps, n=n, dtype=str(dtype)[6:],
                                        us=med, ratio=med / floor, correct=ok))
            print(f"done {n} {dtype}", flush=True)
            del inputs
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, commit=os.environ.get("FLASHMAX_COMMIT"))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "stream-probe.json"), "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)
    print(meta)
    for r in records:
        print(f"{r['dtype']:8} {r['n']:6d} {str(r['steps']):4} {r['variant']:20} "
              f"{r['us']:8.1f} x{r['ratio']:.2f} {'' if r.get('correct', True) else 'WRONG'}")


if __name__ == "__main__":
    main()
