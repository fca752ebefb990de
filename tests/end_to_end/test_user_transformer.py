"""A user's causal character Transformer with its own sequence loss (``--loss``) and a causal mask
of ``-inf`` in a buffer, trained from a text file by a server without ``--model``: the held-out
loss falls at least 30 % below the untrained model's, with no warning about the mask."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch

from psserver.models import build_model, resolve_model
from tests.procs import metric
from tests.userproject import pythonpath, write_package

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SEQ = 32

CHAR_MODEL = '''
    """A small causal character model: token and position embeddings, a masked Transformer, a head."""
    import torch
    import torch.nn.functional as F
    from torch import nn


    class TinyGPT(nn.Module):
        def __init__(self, vocab: int, dim: int = 64, heads: int = 4, layers: int = 2, seq_len: int = 32):
            super().__init__()
            self.tokens = nn.Embedding(vocab, dim)
            self.positions = nn.Parameter(torch.zeros(seq_len, dim))
            layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab)
            # The common pattern: a causal mask of 0 and -inf, a persistent buffer (in the state_dict).
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len))

        def forward(self, ids):
            t = ids.shape[1]
            h = self.blocks(self.tokens(ids) + self.positions[:t], mask=self.mask[:t, :t], is_causal=True)
            return self.head(self.norm(h))


    def sequence_loss(logits, targets):
        """Next-character cross-entropy over every position of every sequence."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
'''

CHAR_DATA = '''
    """Windows of a text file: each sample the characters t..t+T-1 and, as its target, t+1..t+T."""
    from pathlib import Path

    import torch
    from torch.utils.data import Dataset


    class CharWindows(Dataset):
        def __init__(self, ids, seq_len):
            self.ids, self.seq_len = ids, seq_len

        def __len__(self):
            return (len(self.ids) - 1) // self.seq_len

        def __getitem__(self, i):
            start = i * self.seq_len
            chunk = self.ids[start:start + self.seq_len + 1]
            return chunk[:-1], chunk[1:]


    def vocabulary(path):
        return sorted(set(Path(path).read_text()))


    def text_splits(path, seq_len=32, held_out=0.1):
        text = Path(path).read_text()
        index = {c: i for i, c in enumerate(vocabulary(path))}
        ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        cut = int(len(ids) * (1 - held_out))
        return CharWindows(ids[:cut], seq_len), CharWindows(ids[cut:], seq_len)
'''


def write_text(path) -> None:
    """A learnable text: sentences of a small grammar, seeded."""
    rng = random.Random(0)
    subjects = ["the cat", "a dog", "my friend", "the old man", "our teacher", "a small bird"]
    verbs = ["sees", "likes", "finds", "follows", "paints", "calls"]
    objects = ["the river", "a red ball", "the garden", "an apple", "the moon", "a yellow house"]
    lines = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(6000)]
    path.write_text(" ".join(lines))


@pytest.mark.timeout(420)
def test_a_users_transformer_learns_a_text_file_with_its_own_loss(procs, port, tmp_path, monkeypatch):
    text = tmp_path / "corpus.txt"
    write_text(text)
    code = write_package(tmp_path / "code", "charlm", {"model": CHAR_MODEL, "data": CHAR_DATA})
    monkeypatch.syspath_prepend(str(code))
    from charlm.data import text_splits, vocabulary
    from charlm.model import sequence_loss

    vocab = len(vocabulary(text))
    model_args = json.dumps({"vocab": vocab, "seq_len": SEQ})
    # The untrained model (what every trainer starts from: the server's seed 0) on the held-out text.
    untrained = build_model(resolve_model("charlm.model:TinyGPT", json.loads(model_args)), seed=0).eval()
    _, held_out = text_splits(text, SEQ)
    with torch.no_grad():
        x, y = torch.stack([held_out[i][0] for i in range(len(held_out))]), \
            torch.stack([held_out[i][1] for i in range(len(held_out))])
        before = float(sequence_loss(untrained(x), y))
    sys.modules.pop("charlm.model", None)

    server = procs.server(port, "--optimizer", "adam", "--lr", "0.003")
    t = procs.trainer(port, 0, "--num-trainers", "1", "--model", "charlm.model:TinyGPT", "--model-args", model_args,
                      "--dataset", "charlm.data:text_splits", "--dataset-args", json.dumps({"path": str(text)}),
                      "--loss", "charlm.model:sequence_loss", "--metric", "loss", "--batch-size", "32",
                      "--epochs", "1", env={"PYTHONPATH": pythonpath(code)})
    assert t.wait(360) == 0, t.tail()
    after = metric(t, "loss")
    assert after <= 0.7 * before, (before, after)
    assert "learnt from the first trainer" in server.output()
    # The -inf mask is a constant, not a statistic gone bad: no warning at all.
    assert "buffers" not in server.output() and "WARNING" not in t.output(), (server.tail(), t.tail())
