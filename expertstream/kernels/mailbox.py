"""A CUDA stream and a host thread passing a request and its answer through pinned memory, with no host
launch or sync between them: the CPU share of split decode (experts/split_bank.py) inside the decode graphs.

`post` copies a request ([m] FP32, on the device) into pinned host memory, writes the layer and the expert
count into the mailbox, then, after a system-scope fence, the request's sequence number; the split server
(kernels/cpu_moe.c, `cpu_moe.SplitServer`) spins on that word, computes, writes its [H] FP32 answer and
then the number into box[DONE]. `take` spins on the GPU until box[DONE] holds the number, then returns
part + answer. The number lives in a device word the caller increments before each post (a graph replays
fixed kernel arguments), so each word of the box has one writer. A take that waits past `TAKE_SPINS` reads
(seconds: each is a bus round trip) gives NaN and writes the number into box[FAIL] for the host to raise.

Shapes: box [BOX_WORDS] int32 pinned; seq [1] int32 on the device; the answer [H] FP32 pinned.
"""

from __future__ import annotations

import time

import torch

from expertstream.kernels.codec import jit, next_pow2, require_triton, tl

# the mailbox's words (cpu_moe.c's enum): the GPU writes REQ, LAYER, NREQ and FAIL, the server DONE and ERR
REQ, LAYER, NREQ, DONE, ERR, FAIL = 0, 1, 2, 16, 17, 18
BOX_WORDS = 32
TAKE_SPINS = 1 << 24  # reads of box[DONE] before a take gives up: seconds of bus round trips
BLOCK = 1024


def new_box(pin: bool) -> torch.Tensor:
    """A zeroed mailbox: [BOX_WORDS] int32, pinned (the GPU reads and writes it in place) where `pin`."""
    return torch.zeros(BOX_WORDS, dtype=torch.int32, pin_memory=pin)


def _words():
    from expertstream.kernels import cpu_moe

    lib = cpu_moe.library()
    assert lib is not None, "the mailbox's host side needs the CPU kernel's library (a C compiler)"
    return lib


def post_ref(src: torch.Tensor, dst: torch.Tensor, seq: torch.Tensor, box: torch.Tensor, layer: int, n: int):
    """Plain-torch twin of `post` (same arguments), the host writing the box as the GPU does."""
    lib = _words()
    dst[: src.numel()].copy_(src)
    box[LAYER], box[NREQ] = layer, n
    lib.box_put(box.data_ptr() + 4 * REQ, int(seq))  # a release store: after the request's data


def take_ref(part: torch.Tensor, out: torch.Tensor, seq: torch.Tensor, box: torch.Tensor,
             timeout_s: float = 10.0) -> torch.Tensor:  # fmt: skip
    """Plain-torch twin of `take` (same arguments but a timeout in seconds for the spin count)."""
    lib, want, t0 = _words(), int(seq), time.monotonic()
    while lib.box_get(box.data_ptr() + 4 * DONE) != want:
        if time.monotonic() - t0 > timeout_s:
            box[FAIL] = want
            return torch.full_like(part, float("nan"))
        time.sleep(0)
    return part + out.view_as(part).to(part.device)


@jit(do_not_specialize=("m", "layer", "n"))
def _post_kernel(
    src,
    dst,
    m,
    seq,
    box,
    layer,
    n,
    W_REQ: tl.constexpr,
    W_LAYER: tl.constexpr,
    W_NREQ: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # src [m] FP32 (device) -> dst [m] (pinned host); then box[LAYER], box[NREQ], a fence, box[REQ] = seq
    offs = tl.arange(0, BLOCK)
    for start in range(0, m, BLOCK):
        mask = start + offs < m
        tl.store(dst + start + offs, tl.load(src + start + offs, mask=mask), mask=mask)
    one = tl.arange(0, 1)
    zero = tl.zeros([1], tl.int32)
    tl.store(box + W_LAYER + one, zero + layer)
    tl.store(box + W_NREQ + one, zero + n)
    s = tl.load(seq + one)
    tl.debug_barrier()  # every thread's stores, then the fence: the number lands after all of them
    s = tl.inline_asm_elementwise("fence.sc.sys;\nmov.b32 $0, $1;", "=r,r", [s], tl.int32, False, 1)
    tl.store(box + W_REQ + one, s)


@jit(do_not_specialize=("spins",))
def _take_kernel(
    part, out, dst, seq, box, h, spins, W_DONE: tl.constexpr, W_FAIL: tl.constexpr, BLOCK: tl.constexpr
):
    # spin until box[DONE] == seq (volatile reads of host memory), fence, then dst = part + out ([h] FP32)
    s = tl.load(seq)
    done = tl.load(box + W_DONE, volatile=True)
    i = 0
    while (done != s) & (i < spins):
        done = tl.load(box + W_DONE, volatile=True)
        i += 1
    one = tl.arange(0, 1)
    got = tl.zeros([1], tl.int32) + done
    got = tl.inline_asm_elementwise("fence.acq_rel.sys;\nmov.b32 $0, $1;", "=r,r", [got], tl.int32, False, 1)
    ok = tl.max(got, 0) == s
    offs = tl.arange(0, BLOCK)
    for start in range(0, h, BLOCK):
        mask = start + offs < h
        v = tl.load(out + start + offs, mask=mask, volatile=True) + tl.load(part + start + offs, mask=mask)
        tl.store(dst + start + offs, tl.where(ok, v, float("nan")), mask=mask)
    tl.store(box + W_FAIL + one, tl.zeros([1], tl.int32) + s, mask=(tl.zeros([1], tl.int32) + ok) == 0)


def _check_box(seq: torch.Tensor, box: torch.Tensor) -> None:
    assert box.dtype == torch.int32 and box.shape == (BOX_WORDS,) and box.device.type == "cpu"
    assert seq.dtype == torch.int32 and seq.shape == (1,)


def post(src: torch.Tensor, dst: torch.Tensor, seq: torch.Tensor, box: torch.Tensor, layer: int, n: int):
    """Graphable: src [m] FP32 into dst (pinned host, [m] or longer), box[LAYER] = layer, box[NREQ] = n, then
    box[REQ] = seq[0] once they have landed; the twin where src is on the CPU."""
    _check_box(seq, box)
    assert src.dtype == dst.dtype == torch.float32 and src.is_contiguous() and dst.is_contiguous()
    assert dst.device.type == "cpu" and dst.numel() >= src.numel() and seq.device == src.device
    if src.device.type != "cuda":
        return post_ref(src, dst, seq, box, layer, n)
    require_triton(src)
    assert dst.is_pinned() and box.is_pinned(), "the GPU writes the request into pinned memory"
    _post_kernel[(1,)](src, dst, src.numel(), seq, box, layer, n, W_REQ=REQ, W_LAYER=LAYER, W_NREQ=NREQ,
                       BLOCK=BLOCK)  # fmt: skip


def take(
    part: torch.Tensor, out: torch.Tensor, seq: torch.Tensor, box: torch.Tensor, spins: int = TAKE_SPINS
) -> torch.Tensor:
    """Graphable: wait for box[DONE] == seq[0], then part [1, H] FP32 + out ([H] FP32, pinned host) as a new
    [1, H]; NaN and box[FAIL] = seq[0] past `spins` reads of box[DONE]; the twin where part is on the CPU."""
    _check_box(seq, box)
    assert part.dtype == out.dtype == torch.float32 and part.shape[0] == 1 and part.is_contiguous()
    assert out.device.type == "cpu" and out.numel() == part.numel() and seq.device == part.device
    if part.device.type != "cuda":
        return take_ref(part, out, seq, box)
    require_triton(part)
    assert out.is_pinned() and box.is_pinned(), "the GPU reads the answer from pinned memory"
    dst = torch.empty_like(part)
    _take_kernel[(1,)](part, out, dst, seq, box, part.numel(), spins, W_DONE=DONE, W_FAIL=FAIL,
                       BLOCK=min(BLOCK, next_pow2(part.numel())))  # fmt: skip
    return dst
