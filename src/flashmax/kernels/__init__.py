"""Triton kernels, one module per op family. Triton is optional: `load` returns None without it."""

import importlib


def load(family: str):
    """The kernels module of an op family, or None when Triton is not installed (the pure-torch
    paths cover every device). Any other import error is raised, never mistaken for that."""
    try:
        return importlib.import_module(f"{__name__}.{family}")
    except ModuleNotFoundError as missing:
        if (missing.name or "").split(".")[0] != "triton":
            raise
        return None
