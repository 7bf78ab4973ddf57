"""The mailbox kernels (kernels/mailbox.py) on CUDA: requests posted and answers taken inside a CUDA graph,
the split server (kernels/cpu_moe.c) answering, equal to the CPU kernel on the same blocks."""

import pytest
import torch
from test_cpu_moe import random_blocks

from expertstream.formats.expert_block import ExpertLayout
from expertstream.kernels import cpu_moe, mailbox

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cpu_moe.library() is None, reason="no C compiler to build the CPU kernel"),
]


def two_layers():
    """Two layers of 6 random experts in pinned rows, as in the RAM cache, and a server's buffers: (layout,
    blocks, ws2, rows, addr [2, 6], packed, out, box)."""
    layout = ExpertLayout.for_dims(96, 48)
    blocks, ws2 = random_blocks(layout, 12, seed=3)
    rows = torch.stack(blocks).pin_memory()
    addr = (torch.arange(12, dtype=torch.long) * rows.stride(0) + rows.data_ptr()).view(2, 6)
    packed = torch.empty(2 * cpu_moe.NMAX + 96, pin_memory=True)
    out, box = torch.empty(96, pin_memory=True), mailbox.new_box(pin=True)
    return layout, blocks, ws2, rows, addr, packed, out, box


def answer(layout, blocks, ws2, layer: int, ids, w, x) -> torch.Tensor:
    """The CPU kernel's sum of experts ids of `layer` (of two_layers' tables) for x [H], weights w."""
    e = ids + 6 * layer
    return cpu_moe.moe([blocks[j] for j in e], ws2[e], w[:, None], x[None], layout, 1)


def captured(layer) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """layer(0) and layer(1) run once (compiled), then captured in one graph: (graph, their outputs)."""
    layer(0), layer(1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = (layer(0), layer(1))
    return graph, got


def test_a_graph_posts_two_layers_and_takes_the_servers_answers():
    layout, blocks, ws2, rows, addr, packed, out, box = two_layers()
    server = cpu_moe.SplitServer(addr, ws2.view(2, 6, 3), packed, out, box, layout, threads=2, idle_s=1e-3)
    seq = torch.zeros(1, dtype=torch.int32, device="cuda")
    src, part = torch.zeros(2 * 3 + 96, device="cuda"), torch.zeros(1, 96, device="cuda")

    def layer(i):  # the split layer's device work: a new number, the post, the take
        seq.add_(1)
        mailbox.post(src, packed, seq, box, i, 3)
        return mailbox.take(part, out, seq, box)

    graph, got = captured(layer)
    g = torch.Generator().manual_seed(5)
    for trial in range(6):
        ids, w = torch.randperm(6, generator=g)[:3], torch.rand(3, generator=g)
        x, p = torch.randn(96, generator=g), torch.randn(1, 96, generator=g)
        src.copy_(torch.cat((ids.float(), w, x)))
        part.copy_(p)
        graph.replay()
        server.arm(1 + trial % 3)
        for i in (0, 1):
            assert torch.equal(got[i].cpu(), p + answer(layout, blocks, ws2, i, ids, w, x))
    assert server.stats()[0] == 2 + 2 * 6 and int(seq) == 2 + 2 * 6
    assert box[mailbox.FAIL] == 0 and box[mailbox.ERR] == 0
    server.close()
    seq.add_(1)  # nothing answers now: a take with few spins gives NaN and notes the number in box[FAIL]
    assert mailbox.take(part, out, seq, box, spins=1000).isnan().all()
    assert box[mailbox.FAIL] == int(seq)
