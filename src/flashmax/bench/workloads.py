"""What is measured: input shapes, dtypes and value distributions, drawn reproducibly per workload."""

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# full: forward + backward, GPU time; eager: the same call by the wall clock, host included, against
# PyTorch's own fused row-wise op timed in turn with it (`eager_reference`).
MODES = ("forward", "backward", "full", "eager")
# How a workload's rows lie: "rows", a (tokens, features) tensor over its last dim; "columns", a
# (features, tokens) one over dim 0 — a reduced dim that is not the last, as an [N, C, H, W]
# tensor over C: a row's entries `tokens` apart, neighbouring rows adjacent in memory.
LAYOUTS = ("rows", "columns")

# Tensors a mode must read or write at the least (forward: x, y; backward: y, g, dx; full and eager: all
# five). They set the bytes behind GB/s and the floor: a clone moves two tensors.
TENSORS_MOVED = {"forward": 2, "backward": 3, "full": 5, "eager": 5}
# The losses (`--op sparsemax_loss`): a loss reads x and writes a number a row; its backward reads x
# and writes dx (p - onehot(target), recomputed from x rather than stored); both, x twice and dx.
LOSS_OPS = ("sparsemax_loss", "entmax15_loss")
LOSS_TENSORS_MOVED = {"forward": 1, "backward": 2, "full": 3, "eager": 3}


def tensors_moved(op: str, mode: str) -> int:
    return (LOSS_TENSORS_MOVED if op in LOSS_OPS else TENSORS_MOVED)[mode]


def eager_reference(op: str) -> tuple[str, Callable]:
    """Mode eager's floor, (name, function): PyTorch's own fused row-wise op, forward + backward
    through autograd on the same input (issue #4's end-to-end target: sparsemax within 1.2x of
    torch.softmax at 2048 x 1024): torch.softmax(x, dim), or for a loss cross_entropy(x, target)."""
    if op in LOSS_OPS:
        return "torch cross_entropy", lambda x, target: torch.nn.functional.cross_entropy(
            x, target, reduction="none")
    return "torch.softmax", torch.softmax


def floor_name(op: str, mode: str) -> str:
    """What a mode's times are divided by: a clone scaled to the tensors the mode moves, or in mode
    eager `eager_reference`'s op."""
    return eager_reference(op)[0] if mode == "eager" else "clone"

GPU_TOKENS = 2048
GPU_FEATURES = (1024, 2048, 4096, 8192, 16384, 32768)
GPU_QUICK_FEATURES = (1024, 4096, 32768)
CPU_TOKENS = 256
CPU_FEATURES = (1024, 4096)

# --sweep: every power of two from 8 to 2^20, and real row lengths that are not one (CIFAR-10, CIFAR-100
# and ImageNet classes; the vocabularies of GPT-2, Llama 3, Qwen2 and Gemma 3), each with the fewest rows
# that make a tensor of at least GPU_SWEEP_MIN_BYTES, so that every width moves about the same bytes. A CPU
# sweeps a corner of it. Rows whose length is not a multiple of 16 entries take another path through
# Triton's alignment (benchmarks/NOTES.md, v31), so short ones are here too.
SWEEP_REAL_FEATURES = (10, 100, 1000, 50257, 128256, 151936, 262144)
SWEEP_FEATURES = tuple(sorted({2**k for k in range(3, 21)} | set(SWEEP_REAL_FEATURES)))
SWEEP_QUICK_FEATURES = (8, 1000, 4096, 128256, 1048576)
GPU_SWEEP_MIN_BYTES = 64 * 2**20
CPU_SWEEP_MIN_BYTES = 256 * 2**10
CPU_SWEEP_MAX_FEATURES = 4096


def sweep_tokens(features: int, dtype: str, min_bytes: int) -> int:
    """The fewest rows that make a (rows, features) tensor of dtype at least min_bytes."""
    return -(-min_bytes // (features * DTYPES[dtype].itemsize))


def _randn(shape, generator, device):
    return torch.randn(shape, generator=generator, device=device)


DISTRIBUTIONS = {
    "randn": _randn,
    "rand": lambda shape, gen, device: torch.rand(shape, generator=gen, device=device),
    # Narrow rows: most entries land in the support. Wide rows: support of one or two entries.
    "randn0.01": lambda shape, gen, device: _randn(shape, gen, device) * 0.01,
    "randn10": lambda shape, gen, device: _randn(shape, gen, device) * 10,
    # Few distinct values: many exact ties at the threshold.
    "ties": lambda shape, gen, device: torch.randint(0, 8, shape, generator=gen, device=device) / 8,
}


@dataclass(frozen=True)
class Workload:
    tokens: int
    features: int
    dtype: str
    dist: str
    layout: str = "rows"  # one of LAYOUTS

    @property
    def dim(self) -> int:
        """The dim each row lies along."""
        return 0 if self.layout == "columns" else -1

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def bytes_moved(self, mode: str, op: str = "sparsemax") -> int:
        element_size = torch.empty((), dtype=self.torch_dtype).element_size()
        return tensors_moved(op, mode) * self.tokens * self.features * element_size

    def input(self, device: torch.device) -> torch.Tensor:
        """A fresh x: the same values on every call, so every implementation sees the same input."""
        draw = DISTRIBUTIONS[self.dist]
        return draw(self._shape, self._generator(device, "x"), device).to(self.torch_dtype)

    def grad(self, device: torch.device) -> torch.Tensor:
        """The upstream gradient g of the backward pass, fixed per workload like x."""
        return _randn(self._shape, self._generator(device, "g"), device).to(self.torch_dtype)

    def target(self, device: torch.device) -> torch.Tensor:
        """A loss's class index per row, fixed per workload like x."""
        return torch.randint(self.features, (self.tokens,), generator=self._generator(device, "target"),
                             device=device)

    def loss_grad(self, device: torch.device) -> torch.Tensor:
        """The upstream gradient of a loss (one per row), fixed per workload like x."""
        return _randn((self.tokens,), self._generator(device, "loss g"), device).to(self.torch_dtype)

    @property
    def _shape(self) -> tuple[int, int]:
        return (self.features, self.tokens) if self.layout == "columns" else (self.tokens, self.features)

    def _generator(self, device: torch.device, purpose: str) -> torch.Generator:
        key = f"{self.tokens}x{self.features}:{self.dtype}:{self.dist}:{purpose}"
        if self.layout != "rows":  # rows keep the keys (and inputs) they had before layouts
            key += f":{self.layout}"
        return torch.Generator(device).manual_seed(zlib.crc32(key.encode()))
