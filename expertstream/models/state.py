"""The per-conversation state: everything a forward call reads and advances, preallocated once.

GDN layers: conv [K-1, conv_dim] (last pre-conv rows) and rec [Hv, Dk, Dv] FP32. QSA layers: k, v
[max_model_len, kv_heads, head_dim] after norm and RoPE, idx_k [B * compress_ratio, indexer_head_dim] raw
indexer keys and blk_k [B, indexer_head_dim] the pooled, normalised and roped key of each block, B =
ceil(max_model_len / compress_ratio) (a complete block's key is final; a one-token step also rewrites the
key of the incomplete block it is in, which nothing reads until that block completes). PLE: ple_ctx, the
last ngram_size-1 tokens (EOS at the start), and per PLE layer the last (kernel-1)*dilation normalised conv
inputs. Plus the position and the consumed token ids.

With a shared KV pool (models/kv_pool.py) k, v, idx_k and blk_k are views of the state's range of the pool,
which `check_room` grows before a forward call writes new positions; without one they are the state's own
tensors for the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertstream.models.base import ModelArgs


class KVPoolFull(RuntimeError):
    pass


@dataclass(slots=True)
class Snapshot:
    """Host-RAM copy of a State; KV and indexer keys only up to the filled position."""

    tensors: dict[str, torch.Tensor]
    pos: int
    tokens: list[int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class State:
    def __init__(
        self, args: ModelArgs, max_model_len: int, dtype: torch.dtype, device: torch.device | str, pool=None
    ):
        self.max_model_len = max_model_len
        self.pool = pool
        self.pos = 0
        self.tokens: list[int] = []
        self.conv, self.rec, self.k, self.v, self.idx_k, self.blk_k, self.ple_conv = (
            {},
            {},
            {},
            {},
            {},
            {},
            {},
        )
        conv_dim = 2 * args.linear_num_key_heads * args.linear_key_head_dim
        conv_dim += args.linear_num_value_heads * args.linear_value_head_dim
        rec_shape = (args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim)
        kv_shape = (max_model_len, args.num_key_value_heads, args.head_dim)
        self.compress_ratio = args.indexer_compress_ratio or 1
        for i, kind in enumerate(args.layer_types):
            if kind == "linear_attention":
                self.conv[i] = torch.zeros(
                    args.linear_conv_kernel_dim - 1, conv_dim, dtype=dtype, device=device
                )
                self.rec[i] = torch.zeros(rec_shape, dtype=torch.float32, device=device)
            elif pool is None:
                self.k[i] = torch.zeros(kv_shape, dtype=dtype, device=device)
                self.v[i] = torch.zeros(kv_shape, dtype=dtype, device=device)
                # whole blocks: a one-token step reads the block holding its position (incomplete at the end)
                blocks = -(-max_model_len // self.compress_ratio)
                self.idx_k[i] = torch.zeros(
                    blocks * self.compress_ratio, args.indexer_head_dim, dtype=dtype, device=device
                )
                self.blk_k[i] = torch.zeros(blocks, args.indexer_head_dim, dtype=dtype, device=device)
        for i in args.ple_layers:
            self.ple_conv[i] = torch.zeros(
                args.ple_conv_state_len, args.hc_count * args.hidden_size, dtype=dtype, device=device
            )
        # n-gram context lives on the host: row ids are hashed on the CPU where the PLE reads happen
        self.ple_ctx = torch.full((args.ngram_size - 1,), args.eos_id, dtype=torch.long)
        self._empty_ple_ctx = self.ple_ctx.clone()
        if pool is not None:
            pool.attach(self)

    def _named(self) -> dict[str, tuple[torch.Tensor, int]]:
        """name -> (tensor, d): d = 0 when always whole, else filled up to pos // d rows along dim 0."""
        out = {"ple_ctx": (self.ple_ctx, 0)}
        for kind, d, per in (
            ("conv", self.conv, 0),
            ("rec", self.rec, 0),
            ("k", self.k, 1),
            ("v", self.v, 1),
            ("idx_k", self.idx_k, 1),
            ("blk_k", self.blk_k, self.compress_ratio),
            ("ple_conv", self.ple_conv, 0),
        ):
            out.update({f"{kind}.{i}": (t, per) for i, t in d.items()})
        return out

    def check_room(self, n: int, keep=()) -> None:
        """Room for n more tokens: within max_model_len, and in the KV pool, where other states (none in
        `keep`) may go to host RAM to make it."""
        if self.pos + n > self.max_model_len:
            raise ValueError(
                f"{self.pos} tokens in context + {n} new exceed max_model_len {self.max_model_len}; "
                "start a new conversation or raise --max-model-len"
            )
        if self.pool is not None and not self.pool.fit(self, self.pos + n, lambda o: o not in keep):
            raise KVPoolFull(
                f"the KV pool has no room for {self.pos + n} tokens beside the running sequences"
            )

    @property
    def kv_address(self) -> int:
        """Where the state's KV starts (it moves within a pool): decode graphs are captured per address."""
        return next((t.data_ptr() for t in self.k.values()), 0)

    def advance(self, ids: torch.Tensor) -> None:
        """Record host ids [T] as consumed (called by the model after every layer has written its state)."""
        n = ids.shape[0]
        ids_cpu = ids.cpu()  # a no-op: the model passes the host ids, so no device read-back
        keep = self.ple_ctx.shape[0]
        if keep:
            self.ple_ctx = torch.cat((self.ple_ctx, ids_cpu))[-keep:].clone()
        self.tokens.extend(ids_cpu.tolist())
        self.pos += n

    def reset(self) -> None:
        """Back to an empty conversation: every tensor cleared in place (a pooled KV range freed)."""
        if self.pool is not None:
            self.pool.release(self)
        for t, _ in self._named().values():
            t.zero_()
        self.ple_ctx = self._empty_ple_ctx.clone()
        self.pos = 0
        self.tokens = []

    def snapshot(self) -> Snapshot:
        if self.pool is not None:
            self.check_room(0)  # swapped-out KV comes back first
        tensors = {
            name: (t[: self.pos // per] if per else t).to("cpu", copy=True)
            for name, (t, per) in self._named().items()
        }
        return Snapshot(tensors, self.pos, list(self.tokens))

    def restore(self, snap: Snapshot) -> None:
        """Return to the snapshot's point; continuing from here reproduces what followed the snapshot."""
        if snap.pos > self.max_model_len:
            raise ValueError(
                f"snapshot holds {snap.pos} tokens, more than max_model_len {self.max_model_len}"
            )
        if self.pool is not None:  # a range for the snapshot's tokens, with nothing to carry over
            self.pool.release(self)
            self.pos = 0
            self.check_room(snap.pos)
        for name, (t, per) in self._named().items():
            if name not in snap.tensors:
                raise ValueError(f"snapshot lacks {name}: it was taken from a state of another model")
            (t[: snap.pos // per] if per else t).copy_(snap.tensors[name])
        self.pos = snap.pos
        self.tokens = list(snap.tokens)
