"""A model's reference that another trainer brought is data: no trainer builds it.

The first trainer to join a server without ``--model`` brings the model's layout and values,
and names it. A peer can name anything (``os:system`` with a command as its argument): the
trainers after it must not call that, neither while the server runs nor after ``--resume``
from a checkpoint that recorded the name, nor when someone who may write the server's store
marks that name as the operator's pinned model there."""

from __future__ import annotations

import datetime
import json
import sys
import threading

import pytest
import torch

from psserver.config import TrainerConfig
from psserver.errors import UsageError
from psserver.trainer.session import choose_model
from tests.procs import cli

FORGED = [sys.executable, "-m", "tests.end_to_end.model_naming_trainer"]


def published(model: str | None, pinned: bool, args: dict | None = None) -> dict:
    return {"model": model, "model_args": args or {}, "pinned": pinned, "fingerprint": "f" * 64}


def test_a_brought_reference_is_refused_naming_what_to_pass(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(UsageError, match="never runs code that a peer named") as e:
        choose_model(TrainerConfig(), published("os:system", False, {"command": f"touch {marker}"}))
    assert "'os:system'" in str(e.value) and "--model-args" not in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()
    with pytest.raises(UsageError, match=r"'__main__:Net'.*ps\.replica\(model\)"):
        choose_model(TrainerConfig(), published("__main__:Net", False))


def test_code_the_server_pins_by_reference_is_never_built_only_a_registered_name():
    """The store says what the server pins, and whoever may write the store (or stand in for
    the server) says it too: a reference to code is refused, whatever marks it pinned."""
    with pytest.raises(UsageError, match=r"server runs model 'os:system', code named by reference: psserver never "
                                         r"runs code that a peer named"):
        choose_model(TrainerConfig(), published("os:system", True, {"command": "true"}))
    with pytest.raises(UsageError, match="never runs code that a peer named"):
        choose_model(TrainerConfig(), published("rpc_tutorial:Net", True))
    # A trainer that names the code itself builds it.
    assert choose_model(TrainerConfig(model="tests.trainer.loops:tiny_net"), published("os:system", True)).name \
        == "tests.trainer.loops:tiny_net"


def test_a_pinned_model_is_built_and_a_trainers_own_model_wins():
    assert choose_model(TrainerConfig(), published("mlp", True)).name == "mlp"
    assert choose_model(TrainerConfig(model="mlp"), published("os:system", False)).name == "mlp"
    # The default model the first trainer brought is the one a trainer without --model builds anyway.
    assert choose_model(TrainerConfig(), published("mnist_cnn", False)).name == "mnist_cnn"
    assert choose_model(TrainerConfig(), {"model": None, "fingerprint": None}).name == "mnist_cnn"


def test_a_pinned_model_too_large_for_this_trainer_is_refused_before_it_is_built(monkeypatch):
    """Arguments forged in the store (a vocabulary of 2*10^7) had psserver train build 5.5 GB
    before any refusal: the model is sized on the meta device first."""
    from psserver.trainer import session

    monkeypatch.setattr(session, "available_memory", lambda: 2**30)
    with pytest.raises(UsageError, match=r"the server's model llama_tiny .* is 4\.8 GiB: a replica and its gradients "
                                         r"exceed the 1\.0 GiB this trainer may allocate"):
        choose_model(TrainerConfig(), published("llama_tiny", True, {"vocab": 20_000_000, "dim": 64}))
    assert choose_model(TrainerConfig(), published("mlp", True)).name == "mlp"  # 0.9 MB: built


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_peer_naming_os_system_runs_nothing_in_later_trainers_nor_after_resume(procs, port, tmp_path):
    marker = tmp_path / "ran"
    ckpt = tmp_path / "ckpt"
    server = procs.server(port, "--checkpoint-dir", str(ckpt))
    command = json.dumps({"command": f"touch {marker}"})
    peer = procs.trainer(port, 0, "--model", "mlp", "--max-steps", "2", prefix=[*FORGED, "os:system", command])
    assert peer.wait(120) == 0, peer.tail()
    assert "model os:system" in server.output()  # recorded as what it is: a name

    def victim() -> str:
        """A later trainer, in this process: refused at its join, before it builds a model."""
        r = cli(["train", "--server", f"127.0.0.1:{port}", "--rank", "1", "--no-progress", "--max-steps", "2"])
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        errors = [line for line in r.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1, r.stderr
        return errors[0]

    line = victim()
    assert "never runs code that a peer named" in line and "'os:system'" in line, line
    # Whoever may write the store (anyone who reaches it without a join token) marks the name
    # pinned, as often as it likes, while the next victim starts: the server puts its key back
    # within a poll, but a trainer that read the store would have read the forgery.
    with forged_pin(port, {"command": f"touch {marker}"}):
        line = victim()
    assert "never runs code that a peer named" in line, line
    assert procs.stop(server) == 0, server.tail()
    again = procs.server(port, "--checkpoint-dir", str(ckpt), "--resume")
    again.wait_for("learnt from a checkpoint", timeout=30)
    assert "never runs code that a peer named" in victim()
    # The trainer that names its model itself trains on.
    mine = procs.trainer(port, 1, "--num-trainers", "2", "--model", "mlp", "--max-steps", "2")
    assert mine.wait(120) == 0, mine.tail()
    assert procs.stop(again) == 0, again.tail()
    assert not marker.exists()


class forged_pin:
    """Writes the server's published model back as pinned, with ``args``, until the block ends."""

    def __init__(self, port: int, args: dict) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))
        info = json.loads(self.store.get("psserver/model"))
        self.value = json.dumps({**info, "pinned": True, "model_args": args})
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._write, daemon=True)

    def _write(self) -> None:
        while not self.done.wait(0.002):
            self.store.set("psserver/model", self.value)

    def __enter__(self) -> forged_pin:
        self.store.set("psserver/model", self.value)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(5)


def test_a_class_of_a_script_run_as_a_module_is_named_as_it_imports(monkeypatch):
    import types

    from psserver.trainer.session import class_reference

    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="mypkg.train")
    monkeypatch.setitem(sys.modules, "__main__", main)
    net = type("Net", (), {"__module__": "__main__", "__qualname__": "Net"})
    assert class_reference(net) == "mypkg.train:Net"
    main.__spec__ = None  # python train.py: nothing imports it by a name
    assert class_reference(net) == "__main__:Net"
    assert class_reference(torch.nn.Linear) == "torch.nn.modules.linear:Linear"
