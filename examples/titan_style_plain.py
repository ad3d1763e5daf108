"""A torchtitan-style FSDP2 training loop WITHOUT gpuguard: the baseline `titan_style_train` adopts.

    torchrun --nproc-per-node=2 ... -m gpuguard.examples.titan_style_plain --out DIR --steps 8 [--kill R:S] [--final]

What a user has before adopting gpuguard: a small decoder-only transformer (token embedding, blocks
of RMSNorm + causal attention + SwiGLU MLP, output head), `fully_shard` on every block and then on
the root, AdamW with a linear warm-up (LambdaLR), gradient clipping, and a loop that takes (inputs, labels) from a stateful
dataloader (`state_dict` / `load_state_dict`, as torchdata's `StatefulDataLoader`) and steps the
optimizer. A killed rank ends the job; a restart starts again at step 1.

The model, the data and the step live here and `titan_style_train` imports them, so the two
`main()` functions differ only in the lines adoption changes (README, sharded state, counts them;
`tests/examples/test_titan_style.py` checks the count). The loader reads a dataset of token
sequences (each a function of its id) in the order of `recovery.runtime.data.SampleStream`'s rule:
its position is global (epoch, samples taken), so the adopted loop registers it with the runtime
and a restore at any world size goes on from it (docs/formats/sharded-snapshots.md, "Data position").

`--kill R:S` SIGKILLs rank R at the start of step S, once (a marker file under DIR/faults/).
`--final` gathers the full parameters after the last step into DIR/final.pt (rank 0).
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import LambdaLR

from gpuguard.examples.demo_train import Faults
from gpuguard.examples.fsdp_train import POINT, parse_kill
from gpuguard.recovery.runtime.data import SampleStream


@dataclass(frozen=True)
class ModelArgs:
    """torchtitan's `ModelArgs`, tiny: a CPU with two cores trains it in tens of milliseconds a step."""

    vocab_size: int = 96
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 16
    global_batch: int = 8  # rows a step, over all ranks (divisible by 1, 2, 4, 8)
    samples: int = 96  # token sequences in the dataset (12 steps an epoch)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = a.n_heads, a.dim // a.n_heads
        self.wq, self.wk, self.wv = (nn.Linear(a.dim, a.dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(a.dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(a.dim), nn.RMSNorm(a.dim)
        self.attention, self.feed_forward = Attention(a), FeedForward(a.dim, 4 * a.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(a) for i in range(a.n_layers)})
        self.norm, self.output = nn.RMSNorm(a.dim), nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def build(a: ModelArgs = ModelArgs()) -> tuple[nn.Module, torch.optim.Optimizer, LambdaLR]:
    """The model (seeded: the same initial weights at any world size), sharded per block, AdamW and
    a linear warm-up of the learning rate (torchtitan's). Needs the default process group (`fully_shard`)."""
    torch.manual_seed(0)
    model = Transformer(a)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    return model, optimizer, LambdaLR(optimizer, warmup)


def warmup(step: int, steps: int = 4) -> float:
    """The learning rate's factor at scheduler step `step`: linear from 1/steps to 1 (a function,
    not a lambda, so LambdaLR's state_dict holds no closure)."""
    return min(1.0, (step + 1) / steps)


class TokenLoader(Iterator[tuple[torch.Tensor, torch.Tensor]]):
    """A stateful dataloader of (inputs, labels) for this rank: each step's global batch of sample
    ids under `SampleStream`'s rule, this rank's share of it, each sequence generated from its id.
    `state_dict` / `load_state_dict` are the position's (global: the same on every rank)."""

    def __init__(self, a: ModelArgs = ModelArgs(), seed: int = 7919) -> None:
        self.a, self.stream = a, SampleStream(a.samples, a.global_batch, seed)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.stream.take(dist.get_rank(), dist.get_world_size())
        rows = [
            torch.randint(0, self.a.vocab_size, (self.a.seq_len + 1,), generator=torch.Generator().manual_seed(i))
            for i in ids
        ]
        mine = torch.stack(rows)
        return mine[:, :-1], mine[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.stream.load_state_dict(state)


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LambdaLR, inputs: torch.Tensor, labels: torch.Tensor
) -> float:
    """Forward, next-token cross-entropy, backward, clip (a collective over DTensors), AdamW, the
    scheduler's step."""
    loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten(0, 1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return float(loss.detach())


def write_final(model: nn.Module, out: Path) -> None:
    """Collective: the full (gathered) parameters, written by rank 0 to OUT/final.pt atomically."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        tmp = out / "final.pt.tmp"
        torch.save({k: v.detach().clone() for k, v in full.items()}, tmp)
        os.replace(tmp, out / "final.pt")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output (and, adopted, job) directory")
    ap.add_argument("--steps", type=int, required=True, help="train until this step (inclusive)")
    ap.add_argument("--kill", type=parse_kill, action="append", default=[], metavar="R:S")
    ap.add_argument("--final", action="store_true", help="gather the full parameters at the end (OUT/final.pt)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    faults = Faults(a.out, int(os.environ["RANK"]), a.kill)
    dist.init_process_group("gloo")
    model, optimizer, scheduler = build()
    data = TokenLoader()
    for step in range(1, a.steps + 1):
        faults(POINT, step)
        inputs, labels = next(data)
        train_step(model, optimizer, scheduler, inputs, labels)
    if a.final:
        write_final(model, a.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # FSDP's modules keep the process group alive past destroy_process_group; freed at interpreter
    # finalization, gloo can abort the process (SIGABRT after a clean run, seen in CI): free it now
    gc.collect()
    raise SystemExit(code)
