"""The must-break controls wrap a bank (experts/controls.py): the CPU and the CUDA bank take them the same
way, the wrapped output is broken, and a bank on the same store without the wrapper is not."""

import pytest
import torch
from bank_helpers import routing

from expertstream.experts.controls import controlled
from expertstream.experts.cpu_bank import StreamedExperts
from expertstream.store import ExpertStore
from expertstream.workdir.workdir import Workdir


def staged_decode(bank, layer, x, ids, w):
    """One decode step in stages, as the decode graphs run a "staged" or "fixed" bank (experts/bank.py)."""
    if bank.decode_mode == "fixed":
        y = bank.decode_compute(layer, x, ids, w)
    else:
        want = bank.decode_want(layer, x, ids)
        bank.decode_prepare(layer, want, ids.shape[1])
        y = bank.decode_compute(layer, x, ids, w)
        bank.decode_stage(layer, want, ids.shape[1])
    bank.decode_join()
    bank.decode_launched()
    return y


@pytest.mark.parametrize("control", ["swap-nibbles", "no-experts"])
@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_a_control_breaks_the_wrapped_bank_and_leaves_the_bank_unchanged(
    tiny_workdir, host_alloc, kernel_device, kind, control
):
    wd = Workdir(tiny_workdir)
    if kind == "gpu":
        pytest.importorskip("triton")  # conftest runs it through the interpreter when there is no CUDA
        from expertstream.experts.gpu_bank import GpuExperts

        def make(store):
            return GpuExperts(wd, store, 8, kernel_device)

        dev = kernel_device
    else:

        def make(store):
            return StreamedExperts(wd, store, torch.float32)

        dev = "cpu"
    with ExpertStore(wd, 1 << 20, io_threads=2, **host_alloc) as store:
        ref = StreamedExperts(wd, store, torch.float32)
        plain, broken = make(store), controlled(control, store, make)
        for t in (1, 12):  # a decode step, a prompt
            x, ids, w = routing(wd, t, seed=7 + t)
            want = ref(1, x, ids, w)
            args = [v.to(dev) for v in (x, ids, w)]
            before = plain(1, *args).float().cpu()
            got = broken(1, *args).float().cpu()
            torch.testing.assert_close(before, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
            if control == "no-experts":
                assert torch.count_nonzero(got) == 0
            else:
                assert (got - want).abs().max() > 0.1 * want.abs().max()
            if t == 1 and broken.decode_mode != "eager":  # the stages the decode graphs run give the same
                assert torch.equal(staged_decode(broken, 1, *args).float().cpu(), got)
            # the control altered copies: the same blocks through the bank alone give what they gave before
            assert torch.equal(plain(1, *args).float().cpu(), before)
        plain.close()
        broken.close()


def test_an_unknown_control_is_refused(tiny_workdir):
    wd = Workdir(tiny_workdir)
    with ExpertStore(wd, 0, io_threads=1) as store, pytest.raises(ValueError, match="swap-bytes"):
        controlled("swap-bytes", store, lambda s: StreamedExperts(wd, s, torch.float32))
