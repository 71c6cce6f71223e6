"""The implementations compared: flashmax, the PyTorch sort baseline and published peers, for
each op (sparsemax, entmax15, entmax_bisect, and the losses sparsemax_loss, entmax15_loss).

Every one is optional: a missing package or a missing GPU makes an `Impl` with a reason, never an
error. Each runnable one is a function (x, dim) -> y that supports autograd; entmax_bisect's
loaders give (x, dim, alpha) -> y, and α is bound when the implementation is resolved; the
losses' give (x, target) -> the loss of each row (classes last), and the runner binds target.
"""

import functools
import importlib.metadata
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import flashmax
from flashmax.reference import sparsemax_sort
from flashmax.reference_entmax import entmax15_sort

from .workloads import LOSS_OPS

SparsemaxFn = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class Impl:
    name: str
    version: str
    fn: SparsemaxFn | None
    reason: str | None = None  # why it does not run here; None when it does

    @property
    def available(self) -> bool:
        return self.fn is not None


def _load_flashmax() -> SparsemaxFn:
    return flashmax.sparsemax


def _load_torch_sort() -> SparsemaxFn:
    return sparsemax_sort


def _load_torch_sort_compiled() -> SparsemaxFn:
    return torch.compile(sparsemax_sort)


def _load_entmax() -> SparsemaxFn:
    from entmax import sparsemax

    return lambda x, dim: sparsemax(x, dim=dim)


def _load_entmax_bisect() -> SparsemaxFn:
    from entmax import sparsemax_bisect

    return lambda x, dim: sparsemax_bisect(x, dim=dim)


def _load_liger() -> SparsemaxFn:
    from liger_kernel.transformers import LigerSparsemax

    # One module per dim, built once: building it inside the timed call would add host time.
    module_for = functools.cache(LigerSparsemax)
    return lambda x, dim: module_for(dim)(x)


def _last_dim(fn: Callable[..., torch.Tensor]) -> SparsemaxFn:
    """fn works on the last dim of a contiguous tensor (a no-op for ours); keyword options pass
    through."""
    return lambda x, dim, **options: fn(x.movedim(dim, -1).contiguous(), **options).movedim(-1, dim)


def _load_adasplash() -> SparsemaxFn:
    from adasplash import triton_sparsemax

    return _last_dim(triton_sparsemax)


def _load_flashmax_entmax15() -> SparsemaxFn:
    return flashmax.entmax15


def _load_torch_sort_entmax15() -> SparsemaxFn:
    return entmax15_sort


def _load_torch_sort_compiled_entmax15() -> SparsemaxFn:
    return torch.compile(entmax15_sort)


def _load_entmax_entmax15() -> SparsemaxFn:
    from entmax import entmax15

    return lambda x, dim: entmax15(x, dim=dim)


def _load_entmax_bisect_entmax15() -> SparsemaxFn:
    from entmax import entmax_bisect

    return lambda x, dim: entmax_bisect(x, alpha=1.5, dim=dim)


def _load_adasplash_entmax15() -> SparsemaxFn:
    from adasplash import triton_entmax15

    return _last_dim(triton_entmax15)


def _load_flashmax_entmax_bisect() -> SparsemaxFn:
    return lambda x, dim, alpha: flashmax.entmax_bisect(x, alpha, dim)


def _load_entmax_entmax_bisect() -> SparsemaxFn:
    from entmax import entmax_bisect

    return lambda x, dim, alpha: entmax_bisect(x, alpha, dim=dim)


def _load_adasplash_entmax_bisect() -> SparsemaxFn:
    from adasplash import triton_entmax

    return _last_dim(triton_entmax)


def loss_of(p: torch.Tensor, x: torch.Tensor, target: torch.Tensor, entmax15: bool) -> torch.Tensor:
    """The loss <p - onehot(target), x> + omega(p) of each row, p the prediction for x."""
    omega = (1 - (p * p.sqrt()).sum(-1)) / 0.75 if entmax15 else (1 - (p * p).sum(-1)) / 2
    return (p * x).sum(-1) - x.gather(-1, target.unsqueeze(-1)).squeeze(-1) + omega


def sort_loss(x: torch.Tensor, target: torch.Tensor, entmax15: bool) -> torch.Tensor:
    """The loss from the sort baseline's p, with torch ops (autograd through the sort)."""
    return loss_of((entmax15_sort if entmax15 else sparsemax_sort)(x, -1), x, target, entmax15)


def _load_flashmax_loss(entmax15: bool):
    loss = flashmax.entmax15_loss if entmax15 else flashmax.sparsemax_loss
    return lambda x, target: loss(x, target)


def _load_torch_sort_loss(entmax15: bool):
    return functools.partial(sort_loss, entmax15=entmax15)


def _load_entmax_loss(entmax15: bool):
    from entmax import entmax15_loss, sparsemax_loss

    loss = entmax15_loss if entmax15 else sparsemax_loss
    return lambda x, target: loss(x, target)


@dataclass(frozen=True)
class Peer:
    name: str
    package: str  # the distribution whose version is reported
    load: Callable[[], SparsemaxFn]
    min_version: str | None = None
    needs_gpu: bool = False
    slow_on_cpu: bool = False  # run on a CPU only when asked for by name


PEERS = (
    Peer("flashmax", "flashmax", _load_flashmax),
    Peer("torch-sort", "torch", _load_torch_sort),
    Peer("torch-sort-compiled", "torch", _load_torch_sort_compiled, slow_on_cpu=True),
    Peer("entmax", "entmax", _load_entmax),
    Peer("entmax-bisect", "entmax", _load_entmax_bisect),
    Peer("liger", "liger-kernel", _load_liger, min_version="0.5.10", needs_gpu=True),
    Peer("adasplash", "adasplash", _load_adasplash, min_version="0.2", needs_gpu=True),
)
ENTMAX15_PEERS = (
    Peer("flashmax", "flashmax", _load_flashmax_entmax15),
    Peer("torch-sort", "torch", _load_torch_sort_entmax15),
    Peer("torch-sort-compiled", "torch", _load_torch_sort_compiled_entmax15, slow_on_cpu=True),
    Peer("entmax", "entmax", _load_entmax_entmax15),
    Peer("entmax-bisect", "entmax", _load_entmax_bisect_entmax15),
    Peer("adasplash", "adasplash", _load_adasplash_entmax15, min_version="0.2", needs_gpu=True),
)
ENTMAX_BISECT_PEERS = (
    Peer("flashmax", "flashmax", _load_flashmax_entmax_bisect),
    Peer("entmax-bisect", "entmax", _load_entmax_entmax_bisect),
    Peer("adasplash", "adasplash", _load_adasplash_entmax_bisect, min_version="0.2", needs_gpu=True),
)
def _loss_peers(entmax15: bool) -> tuple[Peer, ...]:
    return (
        Peer("flashmax", "flashmax", functools.partial(_load_flashmax_loss, entmax15)),
        Peer("torch-sort", "torch", functools.partial(_load_torch_sort_loss, entmax15)),
        Peer("entmax", "entmax", functools.partial(_load_entmax_loss, entmax15)),
    )


OPS = ("sparsemax", "entmax15", "entmax_bisect", *LOSS_OPS)
DEFAULT_ALPHA = 1.5  # entmax_bisect's, as in the entmax package
NAMES = tuple(dict.fromkeys(peer.name for peer in PEERS + ENTMAX15_PEERS + ENTMAX_BISECT_PEERS))


def package_version(package: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    if package == "flashmax":  # this package, also when run from a source tree without metadata
        return flashmax.__version__
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def discover(device: torch.device, requested: Sequence[str] | None = None,
             op: str = "sparsemax", alpha: float = DEFAULT_ALPHA) -> list[Impl]:
    """The implementations of op to show, in leaderboard order: all of them, or those requested.
    alpha: entmax_bisect's α."""
    # Looked up here, not in a module-level table: tests replace PEERS.
    op_peers = {"sparsemax": PEERS, "entmax15": ENTMAX15_PEERS, "entmax_bisect": ENTMAX_BISECT_PEERS,
                "sparsemax_loss": _loss_peers(False), "entmax15_loss": _loss_peers(True)}[op]
    return [
        _resolve(peer, device, asked=requested is not None,
                 alpha=alpha if op == "entmax_bisect" else None)
        for peer in op_peers
        if requested is None or peer.name in requested
    ]


def _resolve(peer: Peer, device: torch.device, asked: bool, alpha: float | None) -> Impl:
    version = package_version(peer.package)
    on_gpu = device.type == "cuda"
    if version is None:
        return Impl(peer.name, "", None, "not installed")
    if peer.min_version and _release(version) < _release(peer.min_version):
        return Impl(peer.name, version, None, f"needs {peer.package} >= {peer.min_version}")
    if peer.needs_gpu and not on_gpu:
        return Impl(peer.name, version, None, "needs a GPU")
    if peer.slow_on_cpu and not on_gpu and not asked:
        return Impl(peer.name, version, None, "skipped on CPU (slow to compile; ask with --impls)")
    try:
        fn = peer.load()
    except Exception as error:  # a broken install of an optional peer must not stop the run
        return Impl(peer.name, version, None, f"import failed: {type(error).__name__}: {error}")
    return Impl(peer.name, version, fn if alpha is None else functools.partial(fn, alpha=alpha))
