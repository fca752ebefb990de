"""A generated, learnable classification task: the default of the demo, no download.

Each class has a smooth random prototype; samples are the prototype plus noise, so a model
reaches high accuracy in a few hundred steps and a broken trainer stays near chance.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def make_synthetic(
    input_shape: tuple[int, ...],
    num_classes: int,
    n_train: int = 4096,
    n_eval: int = 1024,
    seed: int = 0,
    noise: float = 3.0,
    input_dtype: torch.dtype | None = None,
) -> tuple[TensorDataset, TensorDataset]:
    gen = torch.Generator().manual_seed(seed)
    n = n_train + n_eval
    labels = torch.randint(0, num_classes, (n,), generator=gen)
    if input_dtype is not None and not input_dtype.is_floating_point:
        # Token models: each class is a random sequence, samples copy it with 20% of the
        # tokens replaced, so the class is learnable from the tokens.
        (seq_len,) = input_shape
        vocab = 256
        protos = torch.randint(0, vocab, (num_classes, seq_len), generator=gen)
        x = protos[labels].clone()
        mask = torch.rand(n, seq_len, generator=gen) < 0.2
        x[mask] = torch.randint(0, vocab, (int(mask.sum()),), generator=gen)
    else:
        protos = torch.randn(num_classes, *input_shape, generator=gen)
        if len(input_shape) == 3:
            # Smooth the prototypes spatially so convolutions have structure to find.
            protos = torch.nn.functional.avg_pool2d(protos, 5, stride=1, padding=2) * 3
        x = protos[labels] + noise * torch.randn(n, *input_shape, generator=gen)
        # Unit variance, as real pipelines normalise (MNIST: mean 0.1307, std 0.3081):
        # large raw inputs make async training with stale gradients diverge.
        x = (x - x.mean()) / x.std()
    return TensorDataset(x[:n_train], labels[:n_train]), TensorDataset(x[n_train:], labels[n_train:])
