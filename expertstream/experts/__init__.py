"""The expert bank: the CPU and GPU banks, the VRAM cache, speculation and the pass tables."""
