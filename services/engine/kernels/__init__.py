"""Triton kernels for the GPU engine: paged attention, RoPE fused with the KV cache write,
fused residual-add RMSNorm and SwiGLU.

Each kernel module imports Triton itself; import the one you need (this package imports
nothing, so CPU-only code can import ``services.engine.kernels`` without Triton). Under
``TRITON_INTERPRET=1`` (set before the kernel module is imported) they run on CPU tensors.
"""
