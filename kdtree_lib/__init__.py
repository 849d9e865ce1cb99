"""kdtree: DDTree speculative decoding (block-diffusion draft trees) for Kimi K2.6, from NumPy
references to CuPy kernels. One module per concept; see docs/DESIGN.md for the data contracts."""
__version__ = "0.1.0"
