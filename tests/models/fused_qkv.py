"""A transformer whose attention projects q, k and v in one fused matmul viewed as ``(B, T, 3, heads, head_dim)``.

Issue 29: planned with ``--tp 2`` it crashed at the first forward ("Cannot unflatten
unevenly sharded tensor"): the fused output split by columns cannot be viewed with
the 3 leading. The planner now leaves that attention replicated (its MLP pair still
splits) and says why.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, WIDTH, HEADS, DEPTH, SEQ_LEN = 32, 16, 2, 2, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, HEADS, C // HEADS)  # (B, T, 3, H, D)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, H, T, D)
        q, k, v = qkv[0], qkv[1], qkv[2]  # 3 x (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)
        return x + self.down(F.gelu(self.up(self.ln2(x))))  # (B, T, C)


class FusedQKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(DEPTH)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.emb(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, V)


def build_model() -> FusedQKV:
    torch.manual_seed(0)
    return FusedQKV()


def _tokens(batch_size: int) -> Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=g)  # (B, T + 1)


def example_inputs(batch_size: int = 8) -> tuple[Tensor]:
    return (_tokens(batch_size)[:, :-1].contiguous(),)  # (B, T)


def example_target(batch_size: int = 8) -> Tensor:
    return _tokens(batch_size)[:, 1:].contiguous()  # (B, T)


def loss_fn(outputs: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), target.reshape(-1))
