"""The one-token decode path: no host sync outside the expert bank, and a bounded number of ATen ops.

`python tests/test_decode_path.py WORKDIR...` prints ops per decode token per layer kind and CPU ms/token
(docs/model.md, "Decode path").
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from expertstream.experts.bank import ExpertBank
from expertstream.models import qwen4_exp
from expertstream.models.base import ModelArgs
from expertstream.models.qwen4_exp import Qwen4ExpModel
from expertstream.models.state import State
from expertstream.store.ple import PleTable
from expertstream.workdir.workdir import Workdir

aten = torch.ops.aten
# ops that make the host wait for the device (a scalar or a data-dependent shape read back)
SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}
# ops that allocate or reinterpret but launch no kernel
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default}


def _bool_index(func, args) -> bool:
    # x[mask] / x[mask] = y run nonzero inside the kernel, out of the mode's sight
    if func not in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        return False
    return any(t is not None and t.dtype == torch.bool for t in args[1])


def _on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def host_sync(func, args, kwargs) -> str | None:
    """Why `func` would make the host wait for the device, or None. CPU tensors are host data."""
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    if (func in SYNC_OPS or _bool_index(func, args)) and any(_on_device(t) for t in tensors):
        return "reads a device value back"
    if func is aten._to_copy.default:
        src, dst = args[0].device.type, torch.device(kwargs.get("device") or args[0].device).type
        if src != "cpu" and dst == "cpu":
            return "copies device -> host"
        if src == "cpu" and dst != "cpu" and not kwargs.get("non_blocking"):
            return "copies host -> device blocking"
    if func is aten.copy_.default and args[0].device != args[1].device:
        if args[0].device.type == "cpu" or not (len(args) > 2 and args[2] or kwargs.get("non_blocking")):
            return "copies between host and device blocking"
    return None


class DecodeCounter(TorchDispatchMode):
    """Counts ATen ops per section (launching ops apart from views); `strict` raises on a host sync."""

    def __init__(self, strict: bool = False):
        super().__init__()
        self.strict, self.paused, self.section, self.stack = strict, False, "top", []
        self.ops, self.kernels = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            why = host_sync(func, args, kwargs) if self.strict else None
            if why:
                raise AssertionError(f"host sync in the decode path: {func} {why} in {self.section}")
            self.ops[self.section] += 1
            if not func.is_view and func not in NO_KERNEL:
                self.kernels[self.section] += 1
        return func(*args, **kwargs)


class CallBank(ExpertBank):
    """A bank whose every call goes to `fn` (decodes eagerly: one host stage)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, layer, x, expert_ids, weights):
        return self.fn(layer, x, expert_ids, weights)


def instrument(model, counter: DecodeCounter) -> list:
    """Attribute ops to `<kind>.<layer>.<part>` sections by module hooks and, for a layer's decode stages,
    by the layer (its PLE stage to the PLE), the PLE's host work to `host`.

    The bank runs with the counter paused. Returns handles whose remove() undoes it all.
    """
    handles = []

    def enter(name):
        def pre(_m, _a):
            counter.stack.append(counter.section)
            counter.section = name

        return pre

    def leave(_m, _a, _o):
        counter.section = counter.stack.pop()

    kinds = model.args.layer_types
    named = {"mixer": model.mixer, "lm_head": model.lm_head}
    for i, layer in enumerate(model.layers):
        kind = "gdn" if kinds[i] == "linear_attention" else "qsa"
        named[f"{kind}.{i}.layer"] = layer
        for part in ("ple", "attn_hc", "linear_attn", "self_attn", "mlp_hc", "mlp"):
            if getattr(layer, part) is not None:
                named[f"{kind}.{i}.{part}"] = getattr(layer, part)
    for name, m in named.items():
        handles += [m.register_forward_pre_hook(enter(name)), m.register_forward_hook(leave)]

    def in_section(name, fn):
        def call(*a):
            enter(name)(None, None)
            try:
                return fn(*a)
            finally:
                leave(None, None, None)

        return call

    def sectioned(name, real):
        """A layer's decode_stages whose stages count in the layer's section, its PLE stage in the PLE's."""
        ple = name.replace(".layer", ".ple")

        def decode_stages(*a):
            stages = real(*a)
            reads_ple = [any(r.startswith("ple_raw") for r in s.reads) for s in stages]
            return [
                dataclasses.replace(s, fn=in_section(ple if p else name, s.fn))
                for s, p in zip(stages, reads_ple)
            ]

        return decode_stages

    def wrap(fn, pause: bool):
        def call(*a):
            if pause:
                counter.paused = True
            else:
                counter.stack.append(counter.section)
                counter.section = "host"
            try:
                return fn(*a)
            finally:
                if pause:
                    counter.paused = False
                else:
                    counter.section = counter.stack.pop()

        return call

    for name, m in named.items():
        if name.endswith(".layer"):
            handles.append(_Patch(m, "decode_stages", sectioned(name, m.decode_stages)))
    for layer in model.layers:
        handles.append(_Patch(layer.mlp, "bank", CallBank(wrap(layer.mlp.bank, pause=True))))
        if layer.ple is not None:
            handles.append(_Patch(layer.ple.table, "read", wrap(layer.ple.table.read, pause=False)))
    handles.append(_Patch(qwen4_exp, "ngram_row_ids", wrap(qwen4_exp.ngram_row_ids, pause=False)))
    return handles


class _Patch:
    """Sets obj.name to value until remove()."""

    def __init__(self, obj, name: str, value):
        self.obj, self.name, self.old = obj, name, getattr(obj, name)
        setattr(obj, name, value)

    def remove(self):
        setattr(self.obj, self.name, self.old)


def per_kind(counts: Counter) -> dict[str, float]:
    """Section counts -> mean per layer of each kind (`gdn`, `qsa`), PLE layers, PLE host work, the rest."""
    out, layers = Counter(), {"gdn": set(), "qsa": set(), "ple": set()}
    for sec, n in counts.items():
        parts = sec.split(".")
        if len(parts) == 3:
            kind = "ple" if parts[2] == "ple" else parts[0]
            out[kind] += n
            layers[kind].add(parts[1])
        else:
            out["host" if sec == "host" else "top"] += n
    return {k: n / len(layers[k]) if k in layers else n for k, n in sorted(out.items())}


def zero_bank(layer, x, expert_ids, weights):
    return torch.zeros_like(x)


def tiny_model(workdir, device: str) -> Qwen4ExpModel:
    """The tiny workdir's network on `device` with a zero expert bank (the bank is not under test here)."""
    wd = Workdir(workdir)
    args = ModelArgs.from_dict(wd.text_config)
    tensors = wd.load_resident()
    bank = CallBank(zero_bank)
    return Qwen4ExpModel(args, tensors, bank, PleTable(wd.ple), torch.float32, device, wd.fp8_row_scaled)


def decode_ids(args: ModelArgs, n: int) -> list[int]:
    ids = torch.randint(0, args.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    ids[[5, 6, 30]] = args.eos_id
    return ids.tolist()


# meta stands in for the GPU on CPU-only machines: the same ops run, no value exists to read back, and every
# host <-> device copy is visible to the checker
DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_decode_steps_never_wait_for_the_device(tiny_workdir, device):
    model = tiny_model(tiny_workdir, device)
    args = model.args
    # from an empty state past the point where the indexer drops blocks, every step one token
    n = (args.indexer_budget // args.indexer_compress_ratio + 4) * args.indexer_compress_ratio
    st = State(args, 128, torch.float32, device)
    counter = DecodeCounter(strict=True)
    handles = instrument(model, counter)
    with counter:
        for t in decode_ids(args, n):
            model.logits(model(torch.tensor([t]), st))
    for h in handles:
        h.remove()
    assert st.pos == n and counter.kernels["top"] > 0


def test_the_sync_checker_catches_reads_and_blocking_copies():
    # must-fail controls: what the old decode path did (a scalar read, a blocking upload, mask indexing)
    x = torch.ones(4, device="meta")
    for bad in (
        lambda: int(x.max()),
        lambda: torch.ones(2).to("meta"),
        lambda: x[x > 0],
        lambda: x.cpu(),
    ):
        with pytest.raises(AssertionError, match="host sync"), DecodeCounter(strict=True):
            bad()


# Launching ATen ops (views and empty allocations excluded) of one fp32 decode step of the tiny workdir's
# network at position 60 (the indexer scoring blocks), expert bank excluded, PLE host work included: 592
# before the lean decode path, 438 after it (docs/model.md, "Decode path"). ~1.2x headroom: a change that
# brings back the old path, or doubles any layer's launches, fails here.
MAX_DECODE_KERNELS = 520


def test_decode_step_op_count_stays_bounded(tiny_workdir):
    model = tiny_model(tiny_workdir, "cpu")
    st = State(model.args, 128, torch.float32, "cpu")
    ids = decode_ids(model.args, 61)
    model(torch.tensor(ids[:60]), st)
    counter = count_decode(model, st, ids[60])
    kernels = sum(counter.kernels.values())
    assert kernels <= MAX_DECODE_KERNELS, f"{kernels} launching ops per decode token: {dict(counter.kernels)}"
    assert counter.kernels["bank"] == 0


def count_decode(model, st, token: int) -> DecodeCounter:
    """ATen ops of one decode step of `model` (no logits), bank excluded."""
    counter = DecodeCounter()
    handles = instrument(model, counter)
    try:
        with counter:
            model(torch.tensor([token]), st)
    finally:
        for h in handles:
            h.remove()
    return counter


def main(workdirs: list[str]) -> None:
    from expertstream.config import EngineConfig
    from expertstream.runtime.engine import Engine

    torch.set_num_threads(1)  # two contended cores: intra-op threads spin on tiny ops and swamp the timing
    for wd in workdirs:
        for dtype in ("float32", "bfloat16"):
            eng = Engine(EngineConfig(model=wd, device="cpu", dtype=dtype, max_model_len=4096))
            st = eng.new_state()
            ids = torch.randint(0, eng.args.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
            eng.forward(st, ids[:200])
            for t in ids[200:220].tolist():  # warm the expert cache
                eng.forward(st, [t])
            counter = count_decode(eng.model, st, int(ids[220]))
            ops, kern = per_kind(counter.ops), per_kind(counter.kernels)
            print(f"{wd} {dtype}: ATen ops per decode token at position 220 (bank excluded)")
            for k in ops:
                print(f"  {k:4s} ops {ops[k]:7.1f}  launching {kern.get(k, 0):7.1f}")
            print(f"  total ops {sum(counter.ops.values())}, launching {sum(counter.kernels.values())}")
            if dtype == "float32":
                ms = time_decode(eng, st, ids[221:300].tolist())
                print(f"  CPU ms/token, median of positions 221-299: {ms}")
            eng.close()


def time_decode(eng, st, toks: list[int]) -> str:
    """Median CPU ms per decode token through `eng.forward`, and the same outside the expert bank."""
    bank, bank_s = eng.model.layers[0].mlp.bank, 0.0

    def timed(*a):
        nonlocal bank_s
        t0 = time.perf_counter()
        y = bank(*a)
        bank_s += time.perf_counter() - t0
        return y

    for layer in eng.model.layers:
        layer.mlp.bank = CallBank(timed)
    total, outside = [], []
    for t in toks:
        bank_s, t0 = 0.0, time.perf_counter()
        eng.forward(st, [t])
        total.append((time.perf_counter() - t0) * 1e3)
        outside.append(total[-1] - bank_s * 1e3)
    return f"{statistics.median(total):.2f} total, {statistics.median(outside):.2f} outside the expert bank"


if __name__ == "__main__":
    main(sys.argv[1:])
