"""`check --layers`: where in the network a BF16 model moves away from the FP32 truth, operation by operation.

Hooks record, over a prompt's positions, each layer's intermediate results on every side: transformers'
modules (the FP32 truth, its BF16 twin) and the engine's (its prompt pass, plain or layer-major). Each is
compared with the truth's as mean |a - truth| / mean |truth|; the router also by how many tokens pick the
truth's expert set. The ratio engine / transformers-BF16 per operation shows which step adds more error
than BF16 itself must.
"""

from __future__ import annotations

from collections import defaultdict

import torch

# the operations of a decoder layer, in the order they run (names are the report's)
OPS = ("ple", "attn_in", "attention", "moe_in", "router", "experts", "layer_out")


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[1, T, F] or [T, F] -> [T, F] float32 on the host."""
    t = t.detach()
    return (t[0] if t.dim() == 3 else t).float().cpu()


class Recorder:
    """{(layer, op): [rows ...]} in call order while `active`; `take()` returns and clears them."""

    def __init__(self):
        self.active, self.rows = False, defaultdict(list)
        self.handles, self.undo = [], []

    def hook(self, module, key, pick=_first) -> None:
        def record(module, args, out):
            if self.active:
                self.rows[key].append(_rows(pick(out)))

        self.handles.append(module.register_forward_hook(record))

    def take(self) -> dict[tuple, torch.Tensor]:
        out = {k: torch.cat(v) for k, v in self.rows.items()}
        self.rows.clear()
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for undo in self.undo:
            undo()


def record_transformers(model) -> Recorder:
    """A Recorder on transformers' `Qwen4ExpForCausalLM` (hooks stay until `close`)."""
    rec = Recorder()
    for i, layer in enumerate(model.model.layers):
        if layer.ple is not None:
            rec.hook(layer.ple, (i, "ple"))
        rec.hook(layer.attn_hyper_connection, (i, "attn_in"))
        rec.hook(
            layer.linear_attn if layer.layer_type == "linear_attention" else layer.self_attn, (i, "attention")
        )
        rec.hook(layer.mlp_hyper_connection, (i, "moe_in"))
        rec.hook(layer.mlp.gate, (i, "router"))  # (logits, scores, ids): the logits
        rec.hook(layer.mlp.experts, (i, "experts"))  # the routed sum, before the shared expert
        rec.hook(layer, (i, "layer_out"))
    rec.hook(model.model.hyper_connection_mixer, (len(model.model.layers), "mixer"))
    return rec


def record_engine(model) -> Recorder:
    """A Recorder on the engine's `Qwen4ExpModel`: its modules, and each layer's `moe_out` (the bank's
    routed sum in, the layer's streams out), wrapped on the instance so plain and layer-major passes are
    both seen."""
    rec = Recorder()
    for i, layer in enumerate(model.layers):
        if layer.ple is not None:
            rec.hook(layer.ple, (i, "ple"))
        rec.hook(layer.attn_hc, (i, "attn_in"))
        rec.hook(layer.linear_attn or layer.self_attn, (i, "attention"))
        rec.hook(layer.mlp_hc, (i, "moe_in"))
        rec.hook(layer.mlp.gate, (i, "router"))
        inner = layer.moe_out  # bound before the instance attribute shadows it

        def moe_out(x, c, routed, shared_gate, shared, in_place=False, i=i, inner=inner):
            out = inner(x, c, routed, shared_gate, shared, in_place)
            if rec.active:
                rec.rows[(i, "experts")].append(_rows(routed))
                rec.rows[(i, "layer_out")].append(_rows(out))
            return out

        layer.moe_out = moe_out
        rec.undo.append(lambda layer=layer: delattr(layer, "moe_out"))
    rec.hook(model.mixer, (len(model.layers), "mixer"))
    return rec


def compare(rows: dict, truth: dict, k: int) -> dict[tuple, dict]:
    """{(layer, op): {"rel": mean |a - t| / mean |t|, and for the router "same_topk": fraction of tokens
    whose top-k expert set is the truth's}} over the truth's first len(a) rows."""
    out = {}
    for key, a in rows.items():
        if key not in truth:
            continue
        t = truth[key][: a.shape[0]]
        a = a.reshape(t.shape)
        m = {"rel": float((a - t).abs().mean() / t.abs().mean().clamp_min(1e-30))}
        if key[1] == "router":
            same = (a.topk(k, -1).indices.sort(-1).values == t.topk(k, -1).indices.sort(-1).values).all(-1)
            m["same_topk"] = float(same.float().mean())
        out[key] = m
    return out


def merge(per_prompt: list[tuple[int, dict]]) -> dict[tuple, dict]:
    """Position-weighted means over prompts of `compare`'s results: [(positions, result)]."""
    sums, weights = defaultdict(lambda: defaultdict(float)), defaultdict(float)
    for n, res in per_prompt:
        for key, m in res.items():
            weights[key] += n
            for name, v in m.items():
                sums[key][name] += n * v
    return {key: {name: v / weights[key] for name, v in m.items()} for key, m in sums.items()}


def table(sides: dict[str, dict]) -> list[str]:
    """Markdown rows: per layer and operation, each side's relative error to the truth, the ratio of each
    side after the first to the first (transformers BF16), and the router's same-top-k share."""
    names = list(sides)
    base = sides[names[0]]
    head = ["layer", "op", *(f"{n} rel" for n in names), *(f"{n} / {names[0]}" for n in names[1:])]
    head += [f"{n} same top-k" for n in names]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {op: j for j, op in enumerate((*OPS, "mixer"))}
    for key in sorted(base, key=lambda kk: (kk[0], order[kk[1]])):
        vals = [sides[n].get(key) for n in names]
        cells = [str(key[0]), key[1]]
        cells += [f"{v['rel']:.2e}" if v else "-" for v in vals]
        cells += [f"{v['rel'] / base[key]['rel']:.2f}" if v and base[key]["rel"] else "-" for v in vals[1:]]
        cells += [f"{v['same_topk']:.1%}" if v and "same_topk" in v else "" for v in vals]
        rows.append("| " + " | ".join(cells) + " |")
    return rows
