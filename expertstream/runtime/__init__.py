"""GPU runtime: the VRAM tier of the expert store and the GPU expert bank built on it."""
