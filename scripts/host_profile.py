"""Where the host's time goes in `ram`-regime prefill and decode (every block in pinned RAM, the VRAM cache,
pieces and spans of `bench prefill`'s ram regime): cProfile of one prompt and of a few decode tokens on the
4-layer full-shape bench model, top functions by own time. The GPU
waits for the host wherever the host cannot run ahead (a prompt's bank call reads its counts back), so host
time per pass and per token is what bounds those paths when the GPU is mostly idle. Usage on a lent GPU:
python3 scripts/host_profile.py [--prompt 2451] [--tokens 32]
"""

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from expertstream.bench_runtime import REAL_LAYERS, ensure_model, real_model_plan, warm_caches
from expertstream.config import EngineConfig
from expertstream.engine import Engine
from expertstream.workdir import Workdir

p = argparse.ArgumentParser()
p.add_argument("--prompt", type=int, default=2451)
p.add_argument("--tokens", type=int, default=32)
p.add_argument("--top", type=int, default=28)
args = p.parse_args()

work = ensure_model(Path("/tmp/expertstream-bench"), 4)
wd = Workdir(work)
expert_gib = wd.num_layers * wd.num_experts * wd.layout.block_bytes / 2**30
cfg = EngineConfig(model=str(work), gpu_memory_gb=8.0, max_model_len=32768, ram_cache_gb=expert_gib + 0.1)
# as `bench prefill`'s ram regime: the 48-layer 8 GiB plan's VRAM cache share, pieces, spans and chunks
real = real_model_plan(wd, 8.0, 32768)
eng = Engine(cfg, vram_cache_blocks=int(real.vram_cache_blocks / REAL_LAYERS * wd.num_layers))
eng.set_prefill(real.prefill_piece, real.prefill_span, real.prefill_chunk)
warm_caches(eng, vram=False)
prompt = torch.randint(1, 200, (args.prompt,)).tolist()


def report(what: str, prof: cProfile.Profile, seconds: float) -> None:
    print(f"\n=== {what}: {seconds:.3f} s wall (unprofiled) ===")
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(f"--- by {key}")
        print("\n".join(line[:150] for line in out.getvalue().splitlines()[6:] if line.strip()))


for _ in range(2):  # the first compiles and warms; the second is timed, then profiled
    st = eng.new_state()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = eng.forward(st, prompt)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
passes = eng.bank.prefill_passes
prof = cProfile.Profile()
st = eng.new_state()
prof.enable()
logits = eng.forward(st, prompt)
torch.cuda.synchronize()
prof.disable()
report(f"prefill {args.prompt} ({(eng.bank.prefill_passes - passes)} passes)", prof, wall)

tok = int(logits.argmax())
for _ in range(6):
    tok = int(eng.forward(st, [tok]).argmax())
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(args.tokens):
    tok = int(eng.forward(st, [tok]).argmax())
wall = (time.perf_counter() - t0) / args.tokens
prof = cProfile.Profile()
prof.enable()
for _ in range(args.tokens):
    tok = int(eng.forward(st, [tok]).argmax())
prof.disable()
report(f"decode, {args.tokens} tokens ({1e3 * wall:.2f} ms/token)", prof, wall * args.tokens)
eng.close()
