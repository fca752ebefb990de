"""``psserver train``'s loop (``psserver.trainer.loop``) with a user's model whose output is a
dict: its ``--metric`` scores it; a built-in metric is refused before training."""

from __future__ import annotations

import pytest

from tests.procs import metric

USER = "tests.trainer.loops"
DICT_MODEL = ["--num-trainers", "1", "--model", f"{USER}:DictNet", "--dataset", f"{USER}:tiny_splits",
              "--loss", f"{USER}:dict_loss", "--batch-size", "16", "--epochs", "2"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_dict_output_is_scored_by_the_users_metric_and_a_builtin_one_is_refused_before_training(procs, port):
    procs.server(port)
    t = procs.trainer(port, 0, *DICT_MODEL, "--metric", f"{USER}:dict_accuracy")
    assert t.wait(120) == 0, t.tail()
    assert 0.0 <= metric(t, "dict_accuracy") <= 1.0
    bad = procs.trainer(port, 0, *DICT_MODEL, "--metric", "accuracy")
    assert bad.wait(120) == 2, bad.tail()
    out = bad.output()
    errors = [line for line in out.splitlines() if line.startswith("psserver train: error:")]
    assert len(errors) == 1 and "metric accuracy needs the model's outputs as one tensor" in errors[0], out
    assert "--metric MODULE:ATTR" in errors[0] and "Traceback" not in out
    assert "training samples" not in out  # refused before the loop started
