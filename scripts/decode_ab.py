"""Decode kernel A/B on a lent GPU: time per call of the tree on PYTHONPATH (blocks in VRAM and in pinned host
RAM, graph-timed as `bench kernels` does) and each launch's share from a torch.profiler trace of one replay.
Run with this tree's expertstream/bench/kernels.py (scripts/device_kernels.sh copies it into an older tree).
"""

from expertstream.bench.kernels import EXPERTS, decode_calls, graph_ms, launch_us, random_bank

layout, slots, ws2 = random_bank(EXPERTS)
for place in ("vram", "host"):
    calls = decode_calls(layout, slots, ws2, place)
    print(f"decode {place} {1e3 * graph_ms(calls):.1f} us per call")
    for name, us in launch_us(calls).items():
        print(f"  {place} {name[:60]:60s} {us:8.1f} us per call")
