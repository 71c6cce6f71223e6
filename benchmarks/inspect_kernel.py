"""Compile a flashmax Triton kernel for an H200 (sm_90a) on any host, GPU or not, and report
what decides its speed before spending GPU time: registers and spills (ptxas), barriers,
shared-memory traffic and global accesses in the SASS, and the layout conversions Triton
inserted (TTGIR).

    python benchmarks/inspect_kernel.py sparsemax_forward_kernel --warps 4 \\
        --const BLOCK_M=1 BLOCK_N=16384 GROUP=8 WIDE=0 PREFETCH=0

The launch is specialised as the JIT specialises one over contiguous rows: pointers and the
row length and outer strides divisible by 16, unit strides and `inner` constant 1. Pointer
arguments (capitalised names) point to --dtype, scratch ones (PART, STATE) to its compute
dtype, the rest are i32. Constexprs are given as NAME=VALUE (an int, a tl dtype name, a Triton
function's name, else a string).
Registers depend on the Triton release: run it with the GPU machine's (triton 3.6 there:
`pip install --target DIR --no-deps triton==3.6.0`, then PYTHONPATH=DIR:src) and it reports
what the GPU builds (NOTES v18). `--out DIR` keeps the TTGIR, PTX and SASS.
"""

import argparse
import collections
import importlib
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

MODULES = ("flashmax.kernels.sparsemax", "flashmax.kernels.entmax",
           "flashmax.kernels.entmax_bisect", "flashmax.kernels.distributed")
COMPUTE = {"fp64": "fp64"}  # scratch pointers' dtype; fp32 otherwise
SCRATCH = {"PART", "STATE", "STATS", "ROW_MAX", "TAUS", "CENTRE"}
SASS_OPS = ("BAR", "STS", "LDS", "LDSM", "STSM", "LDG", "STG", "SHFL", "MUFU", "STL", "LDL")
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9.]+)", flags=re.M)
FP64_GAP = 64  # fp64 instructions at most this far apart lie in one stretch of fp64 code


def spills_in_fp64_code(sass: str) -> tuple[int, int]:
    """(spill instructions, those inside stretches of fp64 code) in the SASS: the forwards'
    fp64 code is the rarely taken refinement of tiny rows (`_exact_outputs`), so spills there
    cost only the rows that take it (a heuristic on the instructions' order: a stretch runs
    from one fp64 instruction to the next within FP64_GAP instructions)."""
    opcodes = [match.group(1) for match in INSTRUCTION.finditer(sass)]
    fp64 = [i for i, op in enumerate(opcodes)
            if op.startswith(("DADD", "DMUL", "DFMA", "DSETP", "DMNMX")) or ".F64" in op]
    stretches = [(a, b) for a, b in zip(fp64, fp64[1:]) if b - a <= FP64_GAP]
    spills = [i for i, op in enumerate(opcodes) if op.startswith(("STL", "LDL"))]
    inside = sum(any(a <= i <= b for a, b in stretches) for i in spills)
    return len(spills), inside


def find_function(name: str):
    """The Triton function of that name in MODULES, or None."""
    for module_name in MODULES:
        value = getattr(importlib.import_module(module_name), name, None)
        if isinstance(value, triton.runtime.JITFunction):
            return value
    return None


def find_kernel(name: str):
    kernel = find_function(name)
    if kernel is None:
        raise SystemExit(f"no kernel {name} in {', '.join(MODULES)}")
    return kernel


def parse_value(text: str):
    """A tl dtype by name, an int, a Triton function of MODULES by name (an op's part, e.g.
    BOUND=_sparsemax_chunk_bound), else the text itself (a string constexpr)."""
    if hasattr(tl, text) and isinstance(getattr(tl, text), tl.dtype):
        return getattr(tl, text)
    function = find_function(text)
    if function is not None:
        return function
    try:
        return int(text)
    except ValueError:
        return text


def specialise(fn, dtype: str, consts: dict, aligned_rows=True, adjacent_rows=False):
    """(signature, constexprs, attrs) of a contiguous-rows launch of fn; without aligned_rows,
    n and the outer strides are not known to be multiples of 16 (rows of 8 entries, say); with
    adjacent_rows, rows adjacent in memory instead (a reduced dim that is not the last: stride
    inner 1, inner and the row's stride multiples of 16)."""
    signature, constexprs, attrs = {}, {}, {}
    unit = ("stride_inner",) if adjacent_rows else ("stride_n", "stride_inner")
    for index, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            if name not in consts:
                raise SystemExit(f"{fn.__name__} needs --const {name}=...")
            signature[name], constexprs[(index,)] = "constexpr", consts[name]
        elif name.endswith(unit) or (name == "inner" and not adjacent_rows):
            signature[name], constexprs[(index,)] = "constexpr", 1
        elif name[:1].isupper():
            signature[name] = "*" + (COMPUTE.get(dtype, "fp32") if name in SCRATCH else dtype)
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            aligned = aligned_rows and not getattr(param, "do_not_specialize_on_alignment", False)
            if aligned and (name in ("n", "inner") or name.endswith(("stride_outer",
                                                                      "stride_n"))):
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def ptxas(ptx: str, out_dir: str) -> tuple[str, str]:
    """(ptxas -v's register and spill lines, the SASS) of the PTX."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptx_path, cubin = os.path.join(out_dir, "kernel.ptx"), os.path.join(out_dir, "kernel.cubin")
    command = [os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", ptx_path, "-o", cubin]
    for _ in range(2):
        with open(ptx_path, "w") as f:
            f.write(ptx)
        done = subprocess.run(command, capture_output=True, text=True)
        # The bundled ptxas may be older than the PTX ISA triton writes (the driver's JIT takes
        # it on the GPU machine); the kernels use nothing that the older ISA lacks.
        older = re.search(r"current version is '(\d+\.\d+)'", done.stderr)
        if done.returncode == 0 or older is None:
            break
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {older.group(1)}", ptx, flags=re.M)
    if done.returncode:
        raise SystemExit(f"ptxas failed:\n{done.stderr}")
    report = "\n".join(line.split("info    : ")[-1].strip() for line in done.stderr.splitlines()
                       if "registers" in line or "spill" in line)
    sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin],
                          capture_output=True, text=True, check=True).stdout
    return report, sass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel")
    parser.add_argument("--dtype", default="fp32", help="fp32, bf16, fp16 or fp64")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--maxnreg", type=int, help="registers a thread at most (ptxas)")
    parser.add_argument("--const", nargs="*", default=[], metavar="NAME=VALUE")
    parser.add_argument("--out", help="keep kernel.ttgir, kernel.ptx and kernel.sass here")
    parser.add_argument("--unaligned-rows", action="store_true",
                        help="n and the outer strides not multiples of 16, as the JIT sees them")
    parser.add_argument("--adjacent-rows", action="store_true",
                        help="rows adjacent in memory (stride_inner 1), entries strided")
    args = parser.parse_args()
    fn = find_kernel(args.kernel)
    consts = {name: parse_value(value) for name, value in
              (item.split("=", 1) for item in args.const)}
    signature, constexprs, attrs = specialise(fn, args.dtype, consts, not args.unaligned_rows,
                                             args.adjacent_rows)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=args.warps, maxnreg=args.maxnreg))
    out_dir = args.out or tempfile.mkdtemp(prefix="inspect_kernel.")
    os.makedirs(out_dir, exist_ok=True)
    ttgir = compiled.asm["ttgir"]
    report, sass = ptxas(compiled.asm["ptx"], out_dir)
    for name, text in (("kernel.ttgir", ttgir), ("kernel.sass", sass)):
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
    ops = collections.Counter(match.group(1).split(".")[0] for match in INSTRUCTION.finditer(sass))
    print(f"{args.kernel} {args.dtype} warps={args.warps} "
          f"{' '.join(f'{k}={v}' for k, v in consts.items())}")
    print(report)
    print(f"SASS instructions {sum(ops.values())}; "
          + ", ".join(f"{op} {ops[op]}" for op in SASS_OPS if ops[op]))
    spills, inside = spills_in_fp64_code(sass)
    if spills:
        print(f"spill instructions {spills}, {inside} of them inside fp64 code")
    print(f"layout conversions in TTGIR: {ttgir.count('ttg.convert_layout')}")


if __name__ == "__main__":
    main()
