"""PLE row ids against transformers' n-gram embedding, and the pread table reader."""

import os

import pytest
import torch

from expertstream.formats.fp8 import e4m3_to_float
from expertstream.store.ple import DenseTable, PleTable, ngram_row_ids, ngram_rows_one

qwen4 = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig  # noqa: E402

EOS = 5
VOCAB = 40  # small vocabulary: repeated n-grams and EOS runs are common


@pytest.fixture(scope="module")
def tf_ngram():
    cfg = Qwen4ExpTextConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, layer_types=["linear_attention"] * 2,
        ple_layer_ids=[1, 2], ngram_vocab_size_base=300, eos_token_id=EOS, seed=99,
    )  # fmt: skip
    heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    # the second PLE layer (ple_layer_index 1) has its own primes and multipliers
    emb = qwen4.Qwen4ExpTextNGramEmbedding(cfg, heads, layer_idx=1, ple_layer_index=1)
    # width-1 rows holding their own index: the embedding output is the row ids
    with torch.no_grad():
        emb.ngram_embedding.weight.copy_(
            torch.arange(emb.ngram_embedding.weight.shape[0], dtype=torch.float)[:, None]
        )
    return emb, cfg


def ours(emb, cfg, context, ids):
    return ngram_row_ids(
        context, ids, EOS, emb.layer_multipliers, emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets,
        cfg.heads_per_ngram,
    )  # fmt: skip


def random_ids(seed: int, n: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    ids[torch.randperm(n, generator=g)[:3]] = EOS
    return ids


@pytest.mark.parametrize("seed", range(20))
def test_row_ids_equal_transformers_whole_and_step_by_step(tf_ngram, seed):
    emb, cfg = tf_ngram
    ids = random_ids(seed)
    if seed == 0:
        ids[:2] = EOS  # EOS at the very start and twice in a row
    with torch.no_grad():
        want = emb(ids[None], None)[0].long()  # [T, heads]
    start = torch.full((cfg.ngram_size - 1,), EOS)
    assert torch.equal(ours(emb, cfg, start, ids), want)
    # pieces of varying size with the context carried the way State.advance carries it
    ctx, got, i = start, [], 0
    for size in [1, 3, 1, 7, 2, 1, 100]:
        piece = ids[i : i + size]
        if not piece.numel():
            break
        got.append(ours(emb, cfg, ctx, piece))
        ctx = torch.cat((ctx, piece))[-ctx.shape[0] :]
        i += size
    assert torch.equal(torch.cat(got), want)


@pytest.mark.parametrize("seed", range(8))
def test_one_token_rows_in_python_equal_transformers(tf_ngram, seed):
    """Decode's plain-int hash, token by token from the start of a conversation, EOS runs included."""
    emb, cfg = tf_ngram
    ids = random_ids(seed)
    if seed == 0:
        ids[:2] = EOS
    with torch.no_grad():
        want = emb(ids[None], None)[0].long()
    ctx = [EOS] * (cfg.ngram_size - 1)
    args = [emb.layer_multipliers, emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets]
    args = [a.tolist() for a in args]
    for t, tok in enumerate(ids.tolist()):
        assert ngram_rows_one(ctx, tok, EOS, *args, cfg.heads_per_ngram) == want[t].tolist()
        ctx = (ctx + [tok])[1:]


def test_one_token_rows_wrap_like_int64():
    """Multipliers near 2^62 overflow int64 products: the plain-int hash wraps exactly as the tensor one."""
    g = torch.Generator().manual_seed(3)
    mult = torch.tensor([(1 << 62) + 12345, -(1 << 61) - 7, (1 << 62) - 99], dtype=torch.long)
    vocab = torch.tensor([1009, 1013, 997, 991], dtype=torch.long)
    offsets = torch.tensor([0, 1009, 2022, 3019], dtype=torch.long)
    for _ in range(20):
        ctx = torch.randint(0, 50_000, (2,), generator=g)
        tok = torch.randint(0, 50_000, (1,), generator=g)
        want = ngram_row_ids(ctx, tok, 7, mult, vocab, offsets, 2)[0].tolist()
        lists = [a.tolist() for a in (mult, vocab, offsets)]
        assert ngram_rows_one(ctx.tolist(), int(tok), 7, *lists, 2) == want


def write_shards(path, table_bytes: torch.Tensor, rows_per_shard: list[int]) -> list[dict]:
    """One file with a header gap before each shard, as safetensors shards of one file have."""
    shards, data, first = [], bytearray(), 0
    for n in rows_per_shard:
        data += b"\xaa" * 13  # unrelated bytes between shards
        shards.append({"path": str(path), "offset": len(data), "rows": n})
        data += table_bytes[first : first + n].numpy().tobytes()
        first += n
    path.write_bytes(bytes(data))
    return shards


def test_ple_table_reads_only_the_needed_rows(tmp_path):
    width, rows = 6, [10, 7, 9]
    raw = torch.randint(0, 256, (sum(rows), width), dtype=torch.uint8)
    raw[raw.bitwise_and(0x7F) == 0x7F] = 0  # no NaN codes
    shards = write_shards(tmp_path / "ple.bin", raw, rows)
    scale = 0.0107421875
    table = PleTable(
        {"dtype": "float8_e4m3fn", "width": width, "scale": scale, "rows": sum(rows), "shards": shards}
    )
    dense = DenseTable(e4m3_to_float(raw) * scale)
    want_rows = torch.tensor([[0, 9, 10, 25], [16, 17, 9, 0]])  # shard edges, a repeated row
    got = table.decode(table.read(want_rows))
    assert got.shape == (2, 4 * width)
    assert torch.equal(got, dense.decode(dense.read(want_rows)))
    assert table.bytes_read == 6 * width  # six distinct rows, each read once
    with pytest.raises(IndexError, match="26"):
        table.read(torch.tensor([[26]]))
    table.close()


def test_ple_table_reads_a_prompt_ahead_and_serves_its_pieces(tmp_path):
    width, rows = 5, [40, 33, 27]
    raw = torch.randint(0, 256, (sum(rows), width), dtype=torch.uint8)
    shards = write_shards(tmp_path / "ple.bin", raw, rows)
    meta = {"dtype": "float8_e4m3fn", "width": width, "scale": 1.0, "rows": sum(rows), "shards": shards}
    table = PleTable(meta, read_threads=3)
    prompt = torch.randint(0, sum(rows), (30, 4), generator=torch.Generator().manual_seed(0))
    prompt[3] = torch.tensor([0, 39, 40, 99])  # shard edges
    table.read_ahead(prompt)
    assert table.bytes_read == prompt.unique().numel() * width  # each distinct row once, on the threads
    assert torch.equal(table.read(prompt), raw[prompt].flatten(-2))  # waits for the reads
    os.truncate(tmp_path / "ple.bin", 0)  # pieces of the prompt now come from the reads ahead only
    for a, b in ((0, 7), (7, 30)):
        assert torch.equal(table.read(prompt[a:b]), raw[prompt[a:b]].flatten(-2))
    assert table.bytes_read == prompt.unique().numel() * width
    outside = torch.tensor([[int(r) for r in range(100) if r not in prompt][0]])
    with pytest.raises(OSError, match="short read"):  # a row not read ahead is read from the (empty) file
        table.read(outside)
    with pytest.raises(IndexError, match="100"):
        table.read_ahead(torch.tensor([[100]]))
    table.close()


def test_ple_table_read_ahead_reports_a_failed_read(tmp_path):
    raw = torch.zeros(8, 4, dtype=torch.uint8)
    shards = write_shards(tmp_path / "ple.bin", raw, [8])
    os.truncate(tmp_path / "ple.bin", shards[0]["offset"] + 4 * 5)
    table = PleTable({"dtype": "float8_e4m3fn", "width": 4, "scale": 1.0, "rows": 8, "shards": shards})
    table.read_ahead(torch.tensor([[1, 7]]))
    with pytest.raises(OSError, match="short read of PLE row 7"):
        table.read(torch.tensor([[1, 7]]))
    table.close()


def test_ple_table_reports_short_reads_and_bad_files(tmp_path):
    raw = torch.zeros(8, 4, dtype=torch.uint8)
    shards = write_shards(tmp_path / "ple.bin", raw, [8])
    meta = {"dtype": "float8_e4m3fn", "width": 4, "scale": 1.0, "rows": 8, "shards": shards}
    os.truncate(tmp_path / "ple.bin", shards[0]["offset"] + 4 * 5)
    table = PleTable(meta)
    with pytest.raises(OSError, match="short read of PLE row 7"):
        table.read(torch.tensor([[7]]))
    table.close()
    with pytest.raises(ValueError, match="rows"):
        PleTable({**meta, "rows": 9})
    with pytest.raises(FileNotFoundError, match="nope"):
        PleTable({**meta, "shards": [{**shards[0], "path": str(tmp_path / "nope")}]})
    with pytest.raises(ValueError, match="dtype"):
        PleTable({**meta, "dtype": "bfloat16"})
