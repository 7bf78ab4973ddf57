"""Which kernels a decode token runs, and for how long: torch.profiler's CUDA kernel records over a few tokens
of a `bench decode` regime (graphs as the engine runs them; CUPTI slows the host, not the kernels). Prints the
kernels a token launches, their summed time, the gaps between back-to-back kernels (launch latency inside a
graph), and the kernels by total time with their count a token. Usage on a lent GPU:
python3 scripts/decode_kernels.py [vram|ram|...] [--layers 4] [--tokens 8]
"""

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from expertstream.bench.runtime import decoding_engine, script_regimes

p = argparse.ArgumentParser()
p.add_argument("regimes", nargs="*", default=["vram"], help="as `bench decode --regimes` names them")
p.add_argument("--layers", type=int, default=4)
p.add_argument("--tokens", type=int, default=8)
p.add_argument("--top", type=int, default=40)
args = p.parse_args()

regimes = script_regimes(args.layers)
for name in args.regimes:
    eng, state, tok = decoding_engine(*regimes[name])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.tokens):
            tok = int(eng.forward(state, [tok]).argmax())
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    n = args.tokens
    total, count = defaultdict(float), defaultdict(int)
    busy, small_gaps = 0.0, 0.0
    for a, b in zip(kernels, kernels[1:]):
        gap = b.time_range.start - a.time_range.end
        if 0 <= gap < 20:  # back to back in one graph or stream: launch latency, not host waits
            small_gaps += gap
    for e in kernels:
        d = e.time_range.elapsed_us()
        busy += d
        total[e.name] += d
        count[e.name] += 1
    head = f"{name}, {eng.workdir.num_layers} layers: {len(kernels) / n:.0f} kernels a token"
    print(f"\n{head}, {busy / n:.1f} us of kernels, {small_gaps / n:.1f} us of gaps under 20 us between them")
    print("   us/token  count/token  us/call  kernel")
    for k in sorted(total, key=total.get, reverse=True)[: args.top]:
        print(f"  {total[k] / n:9.1f}  {count[k] / n:11.1f}  {total[k] / count[k]:7.2f}  {k[:110]}")
    eng.close()
