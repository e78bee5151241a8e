"""Fused Triton kernels of the chunk form: the features made on chip (pricing.py prices the design)."""
