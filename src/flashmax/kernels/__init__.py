"""Triton kernels. Importing this package requires Triton."""
