"""Kernels: each operation beside the plain torch reference that defines what it must compute."""
