"""The task of ``optstate compat``: a GELU MLP learning a fixed random teacher MLP plus noise."""
from __future__ import annotations

import torch

TRAIN, HELD_OUT, BATCH = 4096, 1024, 128


def task(seed: int, bias: bool):
    """The student model (seeded) and the data: a fixed teacher's outputs plus noise, split into
    training and held-out samples."""
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(TRAIN + HELD_OUT, 64, generator=gen)
    teacher = [torch.randn(64, 128, generator=gen) / 8, torch.randn(128, 8, generator=gen) / 11]
    y = torch.nn.functional.gelu(x @ teacher[0]) @ teacher[1] + 0.1 * torch.randn(len(x), 8, generator=gen)
    torch.manual_seed(seed)
    _seed_numpy(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256, bias=bias), torch.nn.GELU(),
                                torch.nn.Linear(256, 256, bias=bias), torch.nn.GELU(), torch.nn.Linear(256, 8, bias=bias))
    return model, (x[:TRAIN], y[:TRAIN]), (x[TRAIN:], y[TRAIN:]), gen


def _seed_numpy(seed: int) -> None:
    """Seed numpy's global stream too: some optimizers draw from it (pytorch-optimizer's Kron picks
    its preconditioner-balancing steps with ``np.random.random()``), and an unseeded draw makes two
    runs of the same optimizer differ."""
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)
