"""Host microseconds per call of the CUDA operations a prompt pass makes (docs/runtime.md: a `ram` prompt's
passes are bound by the host): a non-blocking copy of one 2.76 MB block from registered host memory, 15 such
copies through torch._foreach_copy_, through cudaMemcpyAsync called with ctypes (when the process has loaded
libcudart), an event record, a stream wait, entering a stream context, and a Triton launch of a kernel with
few and with many arguments. Usage on a lent GPU: python3 scripts/cuda_call_cost.py
"""

import ctypes
import time

import torch
import triton
import triton.language as tl

B, N, REPS = 2_764_800, 15, 200
host = torch.empty(64, B, dtype=torch.uint8)
torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)  # as the RAM cache's memory
dev = torch.empty(32, B, dtype=torch.uint8, device="cuda")
rows = torch.randperm(64)[:N].tolist()
side = torch.cuda.Stream()


def per_call(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(REPS):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * dt / REPS / calls


def copies():
    for i, r in enumerate(rows):
        dev[i].copy_(host[r], non_blocking=True)


def foreach():
    torch._foreach_copy_([dev[i] for i in range(N)], [host[r] for r in rows], non_blocking=True)


print(f"copy_ of one block:           {per_call(copies, N):6.1f} us")
print(f"_foreach_copy_, per block:     {per_call(foreach, N):6.1f} us")
lib = next((p.split()[-1] for p in open("/proc/self/maps") if "libcudart.so" in p), None)
if lib:
    rt = ctypes.CDLL(lib)
    rt.cudaMemcpyAsync.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    stream = torch.cuda.current_stream().cuda_stream
    dst = [dev[i].data_ptr() for i in range(N)]
    src = [host[r].data_ptr() for r in rows]

    def raw():
        for d, s in zip(dst, src):
            rt.cudaMemcpyAsync(d, s, B, 1, stream)

    print(f"ctypes cudaMemcpyAsync:        {per_call(raw, N):6.1f} us  ({lib})")
else:
    print("libcudart not loaded by this process: no ctypes probe")
ev = torch.cuda.Event()
print(f"Event() + record:              {per_call(lambda: torch.cuda.Event().record(), 1):6.1f} us")
print(f"record (reused event):         {per_call(lambda: ev.record(), 1):6.1f} us")
print(f"stream.wait_event:             {per_call(lambda: side.wait_event(ev), 1):6.1f} us")


def ctx():
    with torch.cuda.stream(side):
        pass


print(f"enter + leave stream context:  {per_call(ctx, 1):6.1f} us")


@triton.jit
def few(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


@triton.jit
def many(a, b, c, d, e, f, g, h, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, B0: tl.constexpr, B1: tl.constexpr,
         B2: tl.constexpr, B3: tl.constexpr, B4: tl.constexpr, B5: tl.constexpr):  # fmt: skip
    i = tl.arange(0, B0)
    tl.store(a + i, tl.load(b + i, mask=i < n0), mask=i < n0)


x = torch.zeros(1024, device="cuda")
print(f"Triton launch, 2 args:         {per_call(lambda: few[(1,)](x, 16, BLOCK=128), 1):6.1f} us")
consts = dict(B0=128, B1=1, B2=2, B3=3, B4=4, B5=5)
us = per_call(lambda: many[(1,)](*[x] * 8, *range(16, 26), **consts), 1)
print(f"Triton launch, 18 args + 6 c.: {us:6.1f} us")
