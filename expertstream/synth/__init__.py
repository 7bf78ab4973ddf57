"""Synthetic checkpoints in NVIDIA's NVFP4 export layout, and their tokenizer."""
