"""pdserve's own CPU kernels (C, built on first use with the host compiler; see library.py)."""
