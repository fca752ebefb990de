"""--resume with a checkpoint that does not fit: one line, exit 2, files untouched; and one that
fits across servers with and without --model."""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch

from psserver.checkpoint import checkpoint_path, read_checkpoint, write_checkpoint
from psserver.cli import main
from psserver.config import CheckpointConfig, ServerConfig
from psserver.models import build_model, get_model_spec
from psserver.models.layout import ModelLayout, values_of
from psserver.server.server import ParameterServer


def make_checkpoint(tmp_path, model: str, devices: list[str]):
    server = ParameterServer(ServerConfig(model=model, devices=devices))
    try:
        path = checkpoint_path(tmp_path, 7)
        write_checkpoint(path, server.policy.snapshot())
    finally:
        server.engine.close()
    return path


def digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize(
    "saved,argv,fragment",
    [
        (("mlp", ["cpu"]), ["--model", "mnist_cnn"], "is for model 'mlp', this server runs 'mnist_cnn'"),
        (("mlp", ["cpu"]), ["--model", "mlp", "--devices", "cpu,cpu"], "has 1 stage(s), this server has 2"),
    ],
    ids=["other-model", "other-stages"],
)
def test_mismatched_checkpoint_is_refused(tmp_path, capsys, saved, argv, fragment):
    make_checkpoint(tmp_path, *saved)
    before = digest(tmp_path)
    code = main(["serve", "--no-control", "--checkpoint-dir", str(tmp_path), "--resume", *argv])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert digest(tmp_path) == before  # nothing overwritten, nothing added


def test_explicit_corrupt_path_is_refused(tmp_path, capsys):
    path = make_checkpoint(tmp_path, "mlp", ["cpu"])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert main(["serve", "--no-control", "--model", "mlp", "--resume", str(path)]) == 2
    assert "is truncated" in capsys.readouterr().err


def _crafted(tmp_path, change) -> object:
    """A checkpoint of mlp whose payload ``change`` altered, under a valid checksum."""
    path = make_checkpoint(tmp_path, "mlp", ["cpu"])
    state = read_checkpoint(path)
    write_checkpoint(path, change(state))
    return path


@pytest.mark.parametrize(("change", "fragment"), [
    (lambda s: {k: v for k, v in s.items() if k != "global_step"},
     "is not a psserver checkpoint: it has no global_step"),
    (lambda s: {**s, "samples_seen": None}, "is not a psserver checkpoint: its samples_seen is None, not a count"),
    (lambda s: {**s, "optimizer_config": {"nope": 1}},
     "is not a psserver checkpoint: its optimizer_config has fields no optimizer has (nope)"),
    (lambda s: {**s, "rng": 4}, "is not a psserver checkpoint: its rng is not a random generator's state"),
    (lambda s: {**s, "optimizer_config": {"name": "adam"}, "shards": [{**s["shards"][0], "optimizer": {"state": 5}}]},
     "is not a psserver checkpoint: its shards.0.optimizer is not an optimizer's state (state and param_groups)"),
    (lambda s: {**s, "rng": torch.zeros(3, dtype=torch.uint8)},
     "does not load into this server: RuntimeError: Expected a CPUGeneratorImplState"),
    (lambda s: {**s, "shards": [{**s["shards"][0],
                                 "module": {k: v.to_sparse() for k, v in s["shards"][0]["module"].items()}}]},
     "is not a psserver checkpoint: its shards.0.module.1.weight is a sparse_coo tensor, not a dense real tensor"),
], ids=["no-step", "samples-none", "optimizer-fields", "rng-not-a-state", "optimizer-state", "rng-short", "sparse"])
def test_a_wrong_payload_with_a_valid_checksum_is_refused(tmp_path, capsys, change, fragment):
    """KeyError, TypeError, RuntimeError from deep in the restore (internal errors) before."""
    path = _crafted(tmp_path, change)
    with warnings.catch_warnings(record=True) as caught:  # torch's own (a sparse tensor's) are not shown
        warnings.simplefilter("always")
        assert main(["serve", "--no-control", "--model", "mlp", "--resume", str(path)]) == 2
    assert [str(w.message) for w in caught] == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0] and str(path) in err[0], err


def test_a_wrong_payload_is_not_skipped_for_an_older_checkpoint(tmp_path, capsys):
    """As an unsafe one: not psserver's, so --resume stops at it rather than resume an older step."""
    older = make_checkpoint(tmp_path, "mlp", ["cpu"])
    state = read_checkpoint(older)
    write_checkpoint(checkpoint_path(tmp_path, 8), {**state, "shards": 3}, run="r")
    assert main(["serve", "--no-control", "--model", "mlp", "--checkpoint-dir", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    newest = checkpoint_path(tmp_path, 8)
    assert err == [f"psserver serve: error: {newest} is not a psserver checkpoint: its shards are 3, not a list of the "
                   "model's stages"], err


@pytest.mark.parametrize("saved_with,resumed_with", [("mlp", None), (None, "mlp")],
                         ids=["model-to-no-model", "no-model-to-model"])
def test_a_checkpoint_resumes_with_and_without_model(tmp_path, saved_with, resumed_with):
    """A server started with ``--model mlp`` and one that learnt mlp from its first trainer hold
    the same model under other parameter names (``0.weight`` against ``t0``): each resumes the
    other's checkpoint, its values included (the layout, recorded in both, is what is checked)."""
    model = build_model(get_model_spec("mlp", None), seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # not what a fresh build of mlp holds
    server = ParameterServer(ServerConfig(model=saved_with, devices=["cpu"]))
    try:
        layout = ModelLayout.of(model)
        if saved_with is None:
            server.engine.adopt(layout, values_of(model, layout), "mlp", {})
        else:
            server.engine.shards[0].module.load_state_dict(model.state_dict())
        path = checkpoint_path(tmp_path, 7)
        write_checkpoint(path, server.policy.snapshot())
    finally:
        server.engine.close()
    resumed = ParameterServer(ServerConfig(model=resumed_with, devices=["cpu"],
                                           checkpoint=CheckpointConfig(directory=tmp_path, resume="latest")))
    try:
        got = [p.detach() for p in resumed.engine.params]
        assert [tuple(p.shape) for p in got] == [tuple(p.shape) for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(got, model.parameters(), strict=True))
        assert resumed.engine.model_ref == "mlp"
    finally:
        resumed.engine.close()


def test_a_header_nested_too_deep_is_one_line(tmp_path, capsys):
    path = tmp_path / "h"
    path.write_bytes(b"[" * 4000 + b"\n")
    assert main(["serve", "--no-control", "--resume", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"psserver serve: error: {path} is not a psserver checkpoint (bad header)"]


def test_an_optimizer_state_that_does_not_fit_its_parameters_is_refused_at_load(tmp_path):
    """An Adam exp_avg of shape [1] for a [256, 784] weight, under a valid checksum, was resumed,
    and the first step killed the server (SIGSEGV in the fused Adam). The unaltered file of the
    same server resumes: the check refuses nothing a server writes."""
    from psserver.checkpoint import CheckpointError
    from psserver.config import OptimizerConfig

    server = ParameterServer(ServerConfig(model="mlp", devices=["cpu"]))
    try:
        server.engine.agree_optimizer(OptimizerConfig(name="adam"), "a test")
        shard = server.engine.shards[0]
        shard.apply({p: torch.ones_like(p) for p in shard.params})
        state = server.policy.snapshot()
    finally:
        server.engine.close()
    write_checkpoint(checkpoint_path(tmp_path / "good", 1), state)
    state["shards"][0]["optimizer"]["state"][0]["exp_avg"] = torch.zeros(1)
    path = checkpoint_path(tmp_path / "bad", 1)
    write_checkpoint(path, state)

    def resume(directory) -> ParameterServer:
        return ParameterServer(ServerConfig(model="mlp", devices=["cpu"],
                                            checkpoint=CheckpointConfig(directory=directory, resume="latest")))

    with pytest.raises(CheckpointError) as e:
        resume(tmp_path / "bad").engine.close()
    assert str(e.value) == (f"{path} is not a psserver checkpoint: its shards.0.optimizer.state.0.exp_avg has shape "
                            "[1], adam keeps it [256, 784] for parameter 1.weight of shape [256, 784]")
    good = resume(tmp_path / "good")
    try:
        assert good.engine.global_step == 0 and good.engine.shards[0].optimizer is not None
    finally:
        good.engine.close()
