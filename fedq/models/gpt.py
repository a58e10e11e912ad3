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
from collections.abc import Callable

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(c, dim=2)  # each (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
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
    def generate_batch(self, rows: list[torch.Tensor], tokens: int, *,
                       temperature: float = 1.0, top_k: int | None = None,
                       generators: list[torch.Generator],
                       on_token: Callable[[list[torch.Tensor]], None] | None = None
                       ) -> list[torch.Tensor]:
        """:meth:`generate` for several prompts at once, one forward pass per token for
        all of them: ``rows[b]`` (1-D, on the model's device) continued by ``tokens``
        tokens sampled with ``generators[b]``; returns the new tokens of each row.

        The rows are right-padded in one buffer. Each row reads its own window (its last
        ``block_size`` tokens, from position 0 as :meth:`generate` does) and samples at
        its own last position; a row's padding lies after its last token, where causal
        attention keeps it from mattering. Each row samples with its own generator, so a
        row's text is :meth:`generate`'s for that prompt and generator whatever else is
        in the batch (equal token for token on the CPU, tests/test_lm.py).
        ``on_token(new)`` is called after each token with each row's new tokens so far."""
        device, block = rows[0].device, self.block_size
        lens = torch.tensor([len(r) for r in rows])  # on the CPU: sizes, no device syncs
        buf = torch.zeros(len(rows), int(lens.max()) + tokens, dtype=torch.long, device=device)
        for b, r in enumerate(rows):
            buf[b, :len(r)] = r
        every = torch.arange(len(rows), device=device)
        for _ in range(tokens):
            start = (lens - block).clamp(min=0)
            width = int((lens - start).max())
            index = (start[:, None] + torch.arange(width)).clamp(max=buf.shape[1] - 1)
            x = buf.gather(1, index.to(device))  # (B, width): each row's window
            last = (lens - start - 1).to(device)
            probs = _sampling(self(x)[every, last], temperature, top_k)  # (B, vocab)
            nxt = torch.cat([torch.multinomial(probs[b:b + 1], 1, generator=g)[0]
                             for b, g in enumerate(generators)])
            buf[every, lens.to(device)] = nxt
            lens = lens + 1
            if on_token is not None:
                on_token([buf[b, len(r):int(lens[b])] for b, r in enumerate(rows)])
        return [buf[b, len(r):len(r) + tokens] for b, r in enumerate(rows)]


def _sampling(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """The distribution a next token is drawn from: logits (B, vocab) in float32 whatever
    precision the forward pass ran in (AMP), over the temperature, cut to the top k."""
    logits = logits.float() / max(temperature, 1e-6)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return F.softmax(logits, dim=-1)


@MODELS.register("gpt")
def gpt(input_shape: tuple[int, ...], num_classes: int, n_layer: int = 4, n_head: int = 4,
        n_embd: int = 128, dropout: float = 0.0) -> nn.Module:
    """input_shape: (block_size,); num_classes: the vocabulary size."""
    return GPT(num_classes, input_shape[0], n_layer, n_head, n_embd, dropout)
