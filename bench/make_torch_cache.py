"""A real-model Triton cache: torch.compile(mode="max-autotune") of a 4-block transformer, forward and backward.

Needs a GPU and PyTorch. This is the kind of cache issue 5 sizes its goals on (hundreds of autotuned kernels);
bench/make_large_cache.py makes a synthetic one without a GPU.
Usage: TRITON_CACHE_DIR=/tmp/tc python bench/make_torch_cache.py [--blocks 4] [--dim 1024]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.dim, 16) for _ in range(args.blocks)]).cuda().to(torch.bfloat16)
    x = torch.randn(args.batch, args.seq, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    step = torch.compile(model, mode="max-autotune")
    start = time.perf_counter()
    step(x).float().square().mean().backward()
    torch.cuda.synchronize()
    print(f"compiled forward+backward in {time.perf_counter() - start:.1f} s;"
          f" cache: {os.environ.get('TRITON_CACHE_DIR', '~/.triton/cache')}")


if __name__ == "__main__":
    main()
