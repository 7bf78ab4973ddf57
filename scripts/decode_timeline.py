"""Where a decode token's wall time goes, without torch.profiler (its CUPTI hooks slow each graph launch ~10x,
so its host gaps are not the engine's). Per stage of the decode program (DecodeGraphs segments: eager host
work or a graph replay), the host time of the call and the GPU span between CUDA events recorded after
each stage; then the tail (lm_head, argmax, the read-back). A GPU span much longer than the kernels in it
means the GPU waited for the host. Usage on a lent GPU: python3 scripts/decode_timeline.py [vram|ram|...]
"""

import argparse
import time
from collections import defaultdict

import torch

from expertstream.bench.runtime import decoding_engine, script_regimes
from expertstream.experts.host_mirror import PackedUpload
from expertstream.runtime import decode_graphs

p = argparse.ArgumentParser()
p.add_argument("regimes", nargs="*", default=["vram", "ram"], help="as `bench decode --regimes` names them")
p.add_argument("--layers", type=int, default=4)
p.add_argument("--tokens", type=int, default=16)
p.add_argument("--stage-guesses", type=int, default=-1)
args = p.parse_args()

regimes = script_regimes(args.layers, args.stage_guesses)  # `bench decode`'s model and regimes

record: list = []  # (segment index, kind, host seconds, event) of the token being run


def timed_replay(self, cap, step):
    for i, seg in enumerate(cap.segments):
        t0 = time.perf_counter()
        if seg[0] == "graph":
            seg[1].replay()
            self._after_launch()
        else:
            _, fns, env, static = seg
            for name, value in decode_graphs._run(fns, env, step).items():
                static[name].copy_(value)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        record.append((i, seg[0], time.perf_counter() - t0, ev))


decode_graphs.DecodeGraphs._replay = timed_replay


def host_input_parts(eng, state, tok: int, reps: int = 200) -> None:
    """Host us per call of each part of a token's host-input stage (segment 0), the GPU idle."""
    model, ids = eng.model, torch.tensor([tok])
    step = decode_graphs._Step(ids, state)
    upload = PackedUpload(model.device)
    ple = [layer.ple for layer in model.layers if layer.ple is not None]
    parts = {
        "embedding row": lambda: model.table_rows(ids),
        "position": lambda: torch.tensor([state.pos]),
        "PLE rows (hash + preads)": lambda: [p.raw_host(ids, state) for p in ple],
        "whole stage (the parts above, packed and uploaded)": lambda: decode_graphs._host_inputs(
            model, step, upload
        ),
    }
    torch.cuda.synchronize()
    for name, fn in parts.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        print(f"  host inputs, {name}: {1e6 * (time.perf_counter() - t0) / reps:.1f} us")
        torch.cuda.synchronize()


for name in args.regimes:
    eng, state, tok = decoding_engine(*regimes[name])
    host, gpu, kinds = defaultdict(float), defaultdict(float), {}
    walls, tails = [], []
    torch.cuda.synchronize()
    for _ in range(args.tokens):
        record.clear()
        start = torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        logits = eng.forward(state, [tok])
        t1 = time.perf_counter()
        tok = int(logits.argmax())
        t2 = time.perf_counter()
        walls.append(t2 - t0)
        tails.append(t2 - t1)
        torch.cuda.synchronize()
        prev = start
        for i, kind, sec, ev in record:
            host[i] += sec
            gpu[i] += prev.elapsed_time(ev) * 1e-3
            kinds[i] = kind
            prev = ev
    n = args.tokens
    print(f"\n{name}: wall {1e3 * sum(walls) / n:.3f} ms/token; argmax read-back (waits for the GPU) "
          f"{1e3 * sum(tails) / n:.3f} ms")  # fmt: skip
    print(" seg kind     host_us  gpu_span_us")
    for i in sorted(host):
        print(f" {i:3d} {kinds[i]:6s} {1e6 * host[i] / n:9.1f} {1e6 * gpu[i] / n:11.1f}")
    print(f" sum        {1e6 * sum(host.values()) / n:9.1f} {1e6 * sum(gpu.values()) / n:11.1f}")
    host_input_parts(eng, state, tok)
    eng.close()
