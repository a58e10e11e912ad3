"""A small GPT (decoder-only transformer), in the style of nanoGPT (Karpathy,
github.com/karpathy/nanoGPT, model.py): token and position embeddings, pre-norm blocks
of causal self-attention and an MLP, a final LayerNorm, and an output head that shares
its weight with the token embedding (weight tying, Press & Wolf 2017). Written here.

Sizes (byte-level vocabulary of 256, context 64):
- default ``n_layer=4, n_head=4, n_embd=128``: about 0.83M parameters, trains on a
  2-core CPU in minutes;
- ``n_layer=6, n_head=6, n_embd=384``: about 10.7M parameters, for a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn
from torch.nn import functional as F

from fedq.models.registry import MODELS


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor, kv: KV | None = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). With ``kv`` (generation): x's keys and values are
        written into it at their positions and x's queries read every cached key up to
        their own position, so one new token costs one position's work."""
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(c, dim=2)  # each (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in (q, k, v))  # (B, nh, T, hs)
        if kv is None:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        else:
            keys, values = kv.write(k, v)  # a prefill is causal; one token reads all it gets
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=kv.mask,
                                               is_causal=t > 1)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))  # (B, T, C)


class KV:
    """One layer's keys and values for the rows being generated, (rows, nh, block, hs),
    filled from position 0 (a row's cache holds its whole sequence while that fits the
    context; after that its window moves and every position changes). For the current
    call, which :meth:`GPT.cached` sets for every layer: ``at``, the position of each
    row's token (one int when every row is at the same one), ``reach``, how many cached
    positions are read, and ``mask``, which of them each row may read (None when every
    row may read all of them)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.at: torch.Tensor | int = 0
        self.reach = 0
        self.mask: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (rows, nh, T, hs) at their positions (T > 1: a prefill from
        position 0; T == 1: one token per row at its own position); returns the cached
        keys and values as far as ``reach``."""
        rows, nh, t, hs = k.shape
        if self.keys is None or self.values is None:
            self.keys = k.new_zeros(rows, nh, self.block_size, hs)
            self.values = v.new_zeros(rows, nh, self.block_size, hs)
        if t > 1:
            self.keys[:, :, :t], self.values[:, :, :t] = k, v
        elif isinstance(self.at, int):
            self.keys[:, :, self.at], self.values[:, :, self.at] = k[:, :, 0], v[:, :, 0]
        else:
            which = torch.arange(rows, device=k.device)
            self.keys[which, :, self.at], self.values[which, :, self.at] = k[:, :, 0], v[:, :, 0]
        return self.keys[:, :, :self.reach], self.values[:, :, :self.reach]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these rows of the cache (indices into its rows), in this order."""
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]


class Block(nn.Module):
    """Pre-norm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, kv: KV | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), kv)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                 n_embd: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual outputs
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (B, T) token ids, T <= block_size -> logits (B, T, vocab)."""
        return self.head(self.features(idx))

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (B, T) -> the last layer's normalised hidden states (B, T, n_embd)."""
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)  # (T,)
        x = self.tok(idx) + self.pos(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)  # (B, T, C)

    def cached(self, idx: torch.Tensor, start: torch.Tensor, kvs: list[KV]) -> torch.Tensor:
        """Logits (L, W, vocab) of idx (L, W), row r's tokens at positions start[r] ..
        start[r] + W - 1 (W > 1 only from position 0: a prefill), reading and extending
        each layer's cache in ``kvs`` (rows in idx's order; ``start`` on the CPU)."""
        w = idx.shape[1]
        reach = int(start.max()) + w
        if reach > self.block_size:
            raise ValueError(f"position {reach - 1} is past block_size {self.block_size}")
        if w > 1 and int(start.max()):
            raise ValueError("several tokens a row are read only from position 0")
        at: torch.Tensor | int
        if int(start.min()) + w == reach:  # every row at the same positions
            at, mask = reach - w, None
            x = self.tok(idx) + self.pos(torch.arange(at, reach, device=idx.device))
        else:  # one token per row, each at its own position, reading up to it
            at = start.to(idx.device)
            mask = (torch.arange(reach, device=idx.device) <= at[:, None])[:, None, None]
            x = self.tok(idx) + self.pos(at[:, None])  # (L, 1, C)
        for block, kv in zip(self.blocks, kvs):
            kv.at, kv.reach, kv.mask = at, reach, mask
            x = block(x, kv)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        """Append ``tokens`` sampled tokens to idx (B, T); returns (B, T + tokens)."""
        for _ in range(tokens):
            probs = _sampling(self(idx[:, -self.block_size:])[:, -1, :], temperature, top_k)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx

    @torch.no_grad()
    def generate_batch(self, rows: list[torch.Tensor], tokens: int | Sequence[int], *,
                       temperature: float | Sequence[float] = 1.0,
                       top_k: int | None | Sequence[int | None] = None,
                       generators: list[torch.Generator],
                       on_token: Callable[[list[torch.Tensor]], None] | None = None,
                       cache: bool = True) -> list[torch.Tensor]:
        """:meth:`generate` for several prompts at once, one forward pass per token for
        all of them: ``rows[b]`` (1-D, on the model's device) continued by ``tokens``
        tokens sampled with ``generators[b]``; returns the new tokens of each row.
        ``tokens``, ``temperature`` and ``top_k`` are one value for every row or one per
        row (a served batch mixes requests); a row that has its tokens leaves the
        forward passes.

        The rows are right-padded in one buffer. Each row reads its own window (its last
        ``block_size`` tokens, from position 0 as :meth:`generate` does) and samples at
        its own last position; a row's padding lies after its last token, where causal
        attention keeps it from mattering. Each row samples with its own generator, so a
        row's text is :meth:`generate`'s for that prompt, settings and generator whatever
        else is in the batch (equal token for token on the CPU, tests/test_lm.py).
        ``on_token(new)`` is called after each token with each row's new tokens so far.

        With ``cache`` (the default) each layer's keys and values are kept (:class:`KV`)
        while a row's sequence fits the context: the prompts are read once, and each
        later token costs one position's work instead of its whole window's. A row
        whose sequence outgrows the context (its window starts to move, so every
        position changes) is read whole again at each token, as without the cache."""
        n = len(rows)
        want = torch.tensor(_per_row(tokens, n), dtype=torch.long)
        temps, ks = _per_row(temperature, n), _per_row(top_k, n)
        device, block = rows[0].device, self.block_size
        lens = torch.tensor([len(r) for r in rows])  # on the CPU: sizes, no device syncs
        ends = lens + want
        buf = torch.zeros(n, int(ends.max()), dtype=torch.long, device=device)
        for b, r in enumerate(rows):
            buf[b, :len(r)] = r
        kvs = [KV(block) for _ in self.blocks]
        held = torch.zeros(0, dtype=torch.long)  # the rows in the cache, in its order
        for step in range(int(want.max())):
            live = (lens < ends).nonzero()[:, 0]  # the rows still generating
            parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, their logits)
            if cache and step == 0:  # the prompts that fit, read once from position 0
                held = live[lens[live] <= block]
                if len(held):
                    x = buf[held.to(device), :int(lens[held].max())]
                    last = (lens[held] - 1).to(device)
                    logits = self.cached(x, torch.zeros(len(held), dtype=torch.long), kvs)
                    parts.append((held, logits[torch.arange(len(held), device=device), last]))
            elif cache and len(held):  # each cached row's newest token, at its position
                kept = (lens[held] < ends[held]) & (lens[held] <= block)
                if not kept.all():
                    keep = kept.nonzero()[:, 0].to(device)
                    for kv in kvs:
                        kv.keep(keep)
                    held = held[kept]
                if len(held):
                    at = lens[held] - 1
                    x = buf[held.to(device), at.to(device)][:, None]  # (H, 1)
                    parts.append((held, self.cached(x, at, kvs)[:, 0]))
            rest = live[~torch.isin(live, held)] if cache else live
            if len(rest):  # whole windows
                at = lens[rest]
                start = (at - block).clamp(min=0)
                width = int((at - start).max())
                index = (start[:, None] + torch.arange(width)).clamp(max=buf.shape[1] - 1)
                x = buf[rest.to(device)].gather(1, index.to(device))  # (R, width): windows
                last = (at - start - 1).to(device)
                parts.append((rest, self(x)[torch.arange(len(rest), device=device), last]))
            picked_rows = torch.cat([r for r, _ in parts])
            picked = picked_rows.tolist()
            logits = torch.cat([lg.float() for _, lg in parts])  # (L, vocab)
            probs = _sampling(logits, [temps[b] for b in picked], [ks[b] for b in picked])
            nxt = torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=generators[b])[0]
                             for i, b in enumerate(picked)])
            buf[picked_rows.to(device), lens[picked_rows].to(device)] = nxt
            lens[picked_rows] += 1
            if on_token is not None:
                on_token([buf[b, len(r):int(lens[b])] for b, r in enumerate(rows)])
        return [buf[b, len(r):int(ends[b])] for b, r in enumerate(rows)]


T = TypeVar("T")


def _per_row(value: T | Sequence[T], n: int) -> list[T]:
    """One setting per row: ``value`` itself for every row, or its ``n`` values."""
    if isinstance(value, Sequence):
        if len(value) != n:
            raise ValueError(f"{len(value)} settings for {n} rows")
        return list(value)
    return [value] * n


def _sampling(logits: torch.Tensor, temperature: float | Sequence[float],
              top_k: int | None | Sequence[int | None]) -> torch.Tensor:
    """The distribution a next token is drawn from: logits (B, vocab) in float32 whatever
    precision the forward pass ran in (AMP), over the temperature, cut to the top k
    (each one value, or one per row)."""
    logits = logits.float()
    temps = _per_row(temperature, len(logits))
    if len(set(temps)) == 1:
        logits = logits / max(temps[0], 1e-6)
    else:  # the same division, row by row
        logits = logits / torch.tensor([max(t, 1e-6) for t in temps],
                                       device=logits.device)[:, None]
    vocab = logits.shape[-1]
    ks = [vocab if k is None else min(k, vocab) for k in _per_row(top_k, len(logits))]
    if min(ks) < vocab:  # rows without a cut keep every logit (their kth is the least)
        top = torch.topk(logits, max(ks)).values  # (B, max k), largest first
        kth = top.gather(1, torch.tensor(ks, device=logits.device)[:, None] - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return F.softmax(logits, dim=-1)


@MODELS.register("gpt")
def gpt(input_shape: tuple[int, ...], num_classes: int, n_layer: int = 4, n_head: int = 4,
        n_embd: int = 128, dropout: float = 0.0) -> nn.Module:
    """input_shape: (block_size,); num_classes: the vocabulary size."""
    return GPT(num_classes, input_shape[0], n_layer, n_head, n_embd, dropout)
