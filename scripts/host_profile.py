"""Where the host's time goes in `ram`-regime prefill and decode (every block in pinned RAM, the VRAM cache,
pieces and spans of `bench prefill`'s ram regime): cProfile of one prompt and of a few decode tokens on the
4-layer full-shape bench model, top functions by own time. The GPU
waits for the host wherever the host cannot run ahead (a prompt's bank call reads its counts back), so host
time per pass and per token is what bounds those paths when the GPU is mostly idle. `--sections` instead
times the prompt's bank steps with perf_counter (no cProfile inflation): ms per pass in the fetch (its store
requests and copies) or, once every block's RAM row is fixed, the rows' copies, the pass map, the launches
and the combine, and the HostMirror waits for the GPU;
`--mirror-depth N` builds the engine with N-deep upload rings (2 was the old form). Usage on a lent GPU:
python3 scripts/host_profile.py [--prompt 2451] [--tokens 32] [--sections] [--mirror-depth N]
"""

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from expertstream.bench.cli import BENCH_WORKDIR
from expertstream.bench.model import REAL_LAYERS, ensure_model
from expertstream.bench.runtime import real_model_plan, warm_caches
from expertstream.config import EngineConfig
from expertstream.runtime.engine import Engine
from expertstream.workdir.workdir import Workdir

p = argparse.ArgumentParser()
p.add_argument("--prompt", type=int, default=2451)
p.add_argument("--tokens", type=int, default=32)
p.add_argument("--top", type=int, default=28)
p.add_argument("--sections", action="store_true")
p.add_argument("--mirror-depth", type=int, default=None)
args = p.parse_args()
if args.mirror_depth:
    from expertstream.experts.host_mirror import HostMirror

    HostMirror.__init__.__defaults__ = (args.mirror_depth,)

work = ensure_model(Path(BENCH_WORKDIR), 4)
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


def sections_report(eng, prompt, wall: float) -> None:
    """One more prompt with the bank's steps wrapped in perf_counter timers: ms per pass of each."""
    from expertstream.experts import gpu_bank as gpu_experts

    bank = eng.bank
    spent: dict[str, float] = {}

    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, wrapper)

    cache = bank.cache
    timed(cache, "fetch", "fetch (all of it)")
    timed(cache, "fetch_host", "  store requests")
    timed(cache, "_copy_blocks", "  copies + scales upload")
    timed(bank, "_plan_ram_passes", "fixed RAM rows: layer's tables")
    timed(cache, "load_pairs", "fixed RAM rows: copy launch")
    timed(bank, "_map_pass", "pass map upload")
    timed(gpu_experts.nvfp4_moe, "nvfp4_moe_prefill_rows", "gate+up and down launches")
    timed(gpu_experts.nvfp4_moe, "combine_rows", "combine launch")
    timed(cache, "mark_used", "mark used")
    timed(bank, "_prefill", "bank prefill calls")
    mirrors = [cache._ws2, bank._slot_map]
    tables = bank._pass_tables
    mirrors += list(tables.mirrors) if tables else []
    waited = sum(m.wait_seconds for m in mirrors)
    passes = bank.prefill_passes
    st = eng.new_state()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.forward(st, prompt)
    torch.cuda.synchronize()
    timed_wall = time.perf_counter() - t0
    n = bank.prefill_passes - passes
    depth = len(cache._ws2._done)
    print(
        f"\n=== prefill {len(prompt)}: {n} passes, mirror depth {depth}; wall {wall:.3f} s untimed, "
        f"{timed_wall:.3f} s with the timers ==="
    )
    for label, sec in spent.items():
        print(f"{label:32s} {1e3 * sec:9.1f} ms  {1e3 * sec / max(n, 1):7.3f} ms/pass")
    wait = sum(m.wait_seconds for m in mirrors) - waited
    print(f"{'  of which mirror waits':32s} {1e3 * wait:9.1f} ms  {1e3 * wait / max(n, 1):7.3f} ms/pass")


for _ in range(2):  # the first compiles and warms; the second is timed, then profiled
    st = eng.new_state()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = eng.forward(st, prompt)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
passes = eng.bank.prefill_passes
if args.sections:
    sections_report(eng, prompt, wall)
    eng.close()
    raise SystemExit
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
