"""Train the bundled demo model: a small qwen4_exp with every architectural feature, on the KJV Bible.

Half the training text is the corpus as it is, half chats built from it (scripts/demo_chat.py): the
template's turns, tool schemas in the system turn, client task prompts, every reply ending in `<|im_end|>`.
The BPE learns the corpus and random tool-schema JSON, so a client's tool list costs few tokens.

Runs transformers' own Qwen4ExpForCausalLM (our oracle) so the weights mean the same thing to both
implementations, then exports the NVIDIA layout (NVFP4 experts, FP8 PLE shards) with our writer.

    scripts/fetch_corpus.sh corpus/            # Debian's bible-kjv-text -> corpus/kjv.txt
    python scripts/train_demo.py --corpus corpus/kjv.txt --out expertstream/assets/demo-snapshot --minutes 7

The last book (Revelation, 404 verses) is held out for perplexity; the 404 verses before it are the validation
text that picks the weights to keep (early stopping), so neither is ever trained on.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch

from expertstream.synth.checkpoint_writer import PREFIX

HELD_OUT_VERSES = 404  # Revelation: the last 404 verses of the KJV (the test text)
VALIDATION_VERSES = 404  # the verses before it (Hebrews..Jude): early stopping, never trained on


def checkpoint_tensors(state: dict[str, torch.Tensor]):
    """transformers' runtime names -> the export's checkpoint names (per-expert, `model.language_model.`)."""
    for name, t in state.items():
        t = t.detach().cpu()
        if name.startswith("lm_head."):
            yield name, t.to(torch.bfloat16)
            continue
        name = PREFIX + name.removeprefix("model.")
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H], gate rows first
            base, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}{e}.gate_proj.weight", t[e, :inter].to(torch.bfloat16)
                yield f"{base}{e}.up_proj.weight", t[e, inter:].to(torch.bfloat16)
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                yield f"{base}{e}.down_proj.weight", t[e].to(torch.bfloat16)
        else:
            yield name, t if t.dtype == torch.long else t.to(torch.bfloat16)


def split_corpus(path: Path) -> tuple[str, str, str]:
    """(train, validation, held-out test) texts, one verse per line."""
    verses = path.read_text(encoding="utf-8").splitlines()
    cut_test, cut_val = len(verses) - HELD_OUT_VERSES, len(verses) - HELD_OUT_VERSES - VALIDATION_VERSES
    return tuple("\n".join(v) + "\n" for v in (verses[:cut_val], verses[cut_val:cut_test], verses[cut_test:]))


def skip_indexer_when_dense(model, seq_len: int, budget: int) -> None:
    """Training windows never exceed the indexer budget, where QSA selects every visible token (exactly the
    causal mask), so the per-query selection loop is replaced by that mask: same maths, far fewer launches."""
    assert seq_len <= budget
    from transformers.models.qwen4_exp import modeling_qwen4_exp as m

    def all_visible(self, hidden_states, position_embeddings, attention_mask, past_key_values, **_):
        return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0

    m.Qwen4ExpTextQSAIndexer.forward = all_visible


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len: int, device: str) -> float:
    """Non-overlapping windows of seq_len + 1 tokens, scored in one batch (every token but the first)."""
    model.eval()
    n = (ids.numel() - 1) // seq_len
    windows = ids[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len).to(device)  # [n, seq_len + 1]
    nll = 0.0
    for b in range(0, n, 64):
        w = windows[b : b + 64]
        logits = model(w[:, :-1]).logits.float()
        targets = w[:, 1:].flatten()
        nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets, reduction="sum").item()
    model.train()
    return math.exp(nll / (n * seq_len))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="snapshot directory to write (NVIDIA layout)")
    p.add_argument("--minutes", type=float, default=7.0, help="training time budget")
    p.add_argument(
        "--steps",
        type=int,
        help="train exactly this many steps instead (the schedule then follows steps, not "
        "the clock, so a rerun on another GPU repeats the schedule)",
    )
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=32768, help="max_position_embeddings (preset: 4096)")
    p.add_argument("--indexer-budget", type=int, help="indexer_budget, >= --seq-len (preset: 128)")
    p.add_argument("--chat-share", type=float, default=0.5, help="share of training windows from chats")
    p.add_argument("--chats", type=int, default=20000, help="conversations rendered for training")
    p.add_argument("--tool-lines", type=int, default=4000, help="random tool schemas the BPE learns")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--vocab", type=int, default=2048, help="BPE merges vocabulary before special tokens")
    p.add_argument("--seed", type=int, default=0)
    # shape overrides of the `demo` preset: a narrow shared expert leaves the work to the routed experts
    p.add_argument("--shared-width", type=int, help="shared_expert_intermediate_size (preset: 128)")
    p.add_argument("--expert-width", type=int, help="moe_intermediate_size (preset: 64)")
    p.add_argument("--experts-per-tok", type=int, help="num_experts_per_tok (preset: 4)")
    p.add_argument(
        "--expert-lr-scale",
        type=float,
        default=1.0,
        help="learning-rate factor of the routed experts, which each see only top-k/E of the tokens",
    )
    p.add_argument("--weight-decay", type=float, default=0.1)
    args = p.parse_args()

    from demo_chat import chat_text, tool_json_lines
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    from expertstream.synth.checkpoint_writer import write_checkpoint
    from expertstream.synth.synth import VOCAB_MULTIPLE, build_config
    from expertstream.synth.tokenizer import build_tokenizer, tokenizer_files
    from expertstream.tokenizer import Tokenizer

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_text, val_text, held_text = split_corpus(args.corpus)
    lines = train_text.splitlines()
    bpe_lines = lines + tool_json_lines(args.tool_lines, args.seed)
    tok = build_tokenizer(bpe_lines, args.vocab)
    tok_files, ids = tokenizer_files(args.context, bpe_lines, args.vocab)
    with tempfile.TemporaryDirectory() as tmp:  # the template as the engine renders it
        for name, text in tok_files.items():
            (Path(tmp) / name).write_text(text, encoding="utf-8")
        chats = chat_text(Tokenizer.from_dir(tmp), lines, args.chats, args.seed)
    vocab_size = -(-tok.get_vocab_size() // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = build_config("demo", None, None, vocab_size, ids)
    cfg = config["text_config"]
    for key, value in (
        ("max_position_embeddings", args.context),
        ("indexer_budget", args.indexer_budget),
        ("shared_expert_intermediate_size", args.shared_width),
        ("moe_intermediate_size", args.expert_width),
        ("num_experts_per_tok", args.experts_per_tok),
    ):
        if value is not None:
            cfg[key] = value
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**cfg)).to(device)
    skip_indexer_when_dense(model, args.seq_len, cfg["indexer_budget"])
    n_params = sum(t.numel() for t in model.parameters())
    print(f"params {n_params / 1e6:.1f}M on {device}", flush=True)

    train_ids = torch.tensor(tok.encode(train_text).ids, dtype=torch.long)
    chat_ids = torch.tensor(tok.encode(chats).ids, dtype=torch.long)
    print(f"chat tokens {chat_ids.numel()} ({len(chats) / chat_ids.numel():.2f} bytes a token)", flush=True)
    val_ids = torch.tensor(tok.encode(val_text).ids, dtype=torch.long)
    held_ids = torch.tensor(tok.encode(held_text).ids, dtype=torch.long)
    print(f"tokens: train {train_ids.numel()}, held-out {held_ids.numel()}", flush=True)
    routed = [t for n, t in model.named_parameters() if ".mlp.experts." in n]
    rest = [t for n, t in model.named_parameters() if ".mlp.experts." not in n]
    groups = [dict(params=rest, scale=1.0), dict(params=routed, scale=args.expert_lr_scale)]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    t0, step, budget_s = time.time(), 0, args.minutes * 60
    best = (float("inf"), 0, None)

    def keep_best(best, step, loss):
        # the weights with the best validation perplexity so far are the ones exported
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            val_ppl = perplexity(model, val_ids, args.seq_len, device)
        print(f"step {step} loss {loss:.3f} val ppl {val_ppl:.2f} {time.time() - t0:.0f}s", flush=True)
        if val_ppl < best[0]:
            return (val_ppl, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
        return best

    warmup = 100
    pick = random.Random(args.seed)

    def progress() -> float:  # share of the budget spent: steps when given, else wall-clock time
        return step / args.steps if args.steps else (time.time() - t0) / budget_s

    while progress() < 1:
        frac = progress()
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr * g["scale"]
        windows = []
        for _ in range(args.batch):  # a window of plain corpus text or of the chats
            src = chat_ids if pick.random() < args.chat_share else train_ids
            s = int(torch.randint(0, src.numel() - args.seq_len - 1, ()))
            windows.append(src[s : s + args.seq_len + 1])
        batch = torch.stack(windows).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(batch[:, :-1], labels=batch[:, :-1].clone(), output_router_logits=True).loss
        # labels are shifted inside the loss, so the targets above are the inputs themselves
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            best = keep_best(best, step, loss.item())
    train_s = time.time() - t0
    best = keep_best(best, step, loss.item())
    model.load_state_dict(best[2])
    print(f"best validation perplexity {best[0]:.2f} at step {best[1]}", flush=True)
    held_ppl = perplexity(model.float(), held_ids, args.seq_len, device)
    print(f"held-out perplexity (bf16 training weights, fp32 eval): {held_ppl:.2f}", flush=True)
    card = {
        "corpus": "King James Bible, Debian package bible-kjv-text (public domain), Revelation held out; "
        f"{args.chat_share:.0%} of the windows from chats built from it (scripts/demo_chat.py)",
        "params": n_params,
        "steps": step,
        "best_step": best[1],
        "validation_ppl": round(best[0], 3),
        "train_seconds": round(train_s),
        "seq_len": args.seq_len,
        "batch": args.batch,
        "held_out_ppl_dense": round(held_ppl, 3),
        "command": "python scripts/train_demo.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
    }
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "do_sample": True,
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
    }
    write_checkpoint(args.out, config, checkpoint_tensors(model.state_dict()), tok_files, "nvfp4", generation)
    (args.out / "heldout.txt").write_text(held_text, encoding="utf-8")
    (args.out / "model_card.json").write_text(json.dumps(card, indent=1) + "\n")
    print(json.dumps(card, indent=1))


if __name__ == "__main__":
    main()
