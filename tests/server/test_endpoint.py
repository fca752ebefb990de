"""The RPC endpoint without RPC: membership touched, the report recorded, calls dispatched
only to the ops a protocol exposes, calls counted for the drain."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import pytest
import torch

from psserver.common.devices import resolve_devices
from psserver.common.messages import Report
from psserver.config import OptimizerConfig, ServerConfig
from psserver.server.endpoint import Endpoint, stopped_at
from psserver.server.engine.engine import StepEngine
from psserver.server.membership import Member
from psserver.server.steps import HALVES
from psserver.telemetry import TrainerStatus
from tests.end_to_end.joins import join_request


class Members:
    """The part of ``Membership`` the endpoint uses (the real one needs an RPC agent)."""

    def __init__(self) -> None:
        self.members: dict[str, Member] = {}
        self.evicted = threading.Event()
        self.handling: set[str] = set()
        """Names whose join the endpoint handles (``joining``)."""

    def join(self, rank: int, name: str, host: str, protocol: str, transport: dict | None = None) -> None:
        status = TrainerStatus(rank, name, host, 0.0, 0.0, transport=(transport or {}).get("kind", ""))
        self.members[name] = Member(status, rpc_id=rank + 1, protocol=protocol)

    @contextlib.contextmanager
    def joining(self, name: str):
        self.handling.add(name)
        try:
            yield
        finally:
            self.handling.discard(name)

    def seen(self, name: str) -> Member:
        m = self.members[name]
        m.last_seen_mono = time.monotonic()
        return m

    def is_member(self, name: str) -> bool:
        return name in self.members

    def leave(self, name: str) -> None:
        self.members.pop(name)

    def evict(self, name: str, reason: str) -> None:
        self.members.pop(name).status.reason = reason
        self.evicted.set()


@pytest.fixture
def endpoint():
    cfg = ServerConfig(model="mlp", devices=["cpu"], optimizer=OptimizerConfig())
    engine = StepEngine(cfg, resolve_devices(cfg.devices))
    ep = Endpoint(cfg, engine, {name: half(engine) for name, half in HALVES.items()}, after_call=lambda: None)
    ep.open(Members())  # type: ignore[arg-type]
    yield ep
    engine.close()


def join(ep: Endpoint, name: str, step: str = "chained", **kw) -> dict:
    return ep.join(join_request(0, name, step=step, optimizer=kw.get("optimizer"), compute=None))


def test_calls_reach_the_protocol_of_the_trainer_and_record_its_report(endpoint):
    reply = join(endpoint, "trainer_0_1")
    assert reply["model"] == "mlp" and reply["optimizer"]["name"] == "adam" and "error" not in reply
    batch = (None, torch.randn(4, 1, 28, 28))
    out, notices, _ = endpoint.call("trainer_0_1", "step", batch, Report(3, 192, 0.5, 100.0))
    assert out.shape == (4, 10) and notices == []
    status = endpoint.membership.seen("trainer_0_1").status
    assert (status.steps, status.samples, status.last_loss) == (3, 192, 0.5)
    assert endpoint.call("trainer_0_1", "evaluate", (torch.randn(2, 1, 28, 28),), None)[0].shape == (2, 10)


def test_only_the_ops_a_protocol_exposes_are_callable(endpoint):
    endpoint.membership.join(0, "trainer_0_5", "h", "plain")  # plain's join needs an RPC agent for its RRefs
    with pytest.raises(ValueError, match="has no call 'submit'"):  # in-process only
        endpoint.call("trainer_0_5", "submit", ({},), None)
    with pytest.raises(ValueError, match="has no call '__init__'"):
        endpoint.call("trainer_0_5", "__init__", (), None)
    with pytest.raises(RuntimeError, match="not a member"):
        endpoint.call("stranger", "forward", (torch.randn(1, 1, 28, 28),), None)


def test_a_trainer_that_names_no_protocol_gets_its_compute_modes_default(endpoint):
    assert join(endpoint, "trainer_0_2", step=None)["step"] == "pushpull"
    reply = endpoint.join(join_request(1, "trainer_1_3", compute="server"))
    assert (reply["step"], reply["compute"]) == ("chained", "server")
    # The path a trainer's buffers take is recorded for the status: trainer compute only.
    assert [endpoint.membership.seen(n).status.transport for n in ("trainer_0_2", "trainer_1_3")] == ["cpu", ""]


def test_a_pinned_compute_mode_refuses_the_other_and_is_every_silent_trainers_default(endpoint):
    endpoint.config.compute = "server"
    assert join(endpoint, "trainer_0_2", step=None)["step"] == "chained"
    refusal = join(endpoint, "trainer_0_3", step="pushpull")["error"]
    assert "runs every step with --compute server" in refusal and "--compute trainer" in refusal
    assert "trainer_0_3" not in endpoint.membership.members
    refusal = endpoint.join(join_request(2, "trainer_2_4", compute=None, wire_dtype="bf16"))["error"]
    assert "--wire-dtype bf16 and --device cpu apply to trainer compute" in refusal


def test_refusals_are_answers_not_errors(endpoint):
    assert "does not speak --step 'turbo'" in join(endpoint, "trainer_0_2", step="turbo")["error"]
    refusal = join(endpoint, "trainer_0_3", optimizer={"name": "sgd"})
    assert "trains with adam" in refusal["error"] and refusal["retry"] is False  # the same answer next time
    endpoint.drain()
    refusal = join(endpoint, "trainer_0_4")
    assert "draining: not accepting trainers" in refusal["error"] and refusal["retry"] is True  # --reconnect waits


def test_a_server_that_is_starting_refuses_for_now(endpoint):
    # several server processes: server 0 admits no trainer while one is missing
    endpoint.state = "WAITING"
    refusal = join(endpoint, "trainer_0_2")
    assert refusal == {"error": "psserver is waiting: not accepting trainers", "retry": True}
    assert endpoint.membership.members == {}
    endpoint.state = "SERVING"
    assert "error" not in join(endpoint, "trainer_0_2")


def test_the_heartbeat_clock_starts_when_the_trainer_has_its_answer(endpoint):
    """The other server processes' part of a join can take seconds (their first optimizer
    imports torch's compiler): a short --trainer-timeout must not run out before the trainer
    has its answer and starts heartbeating (it did, in a CI run: evicted before its first step).
    Meanwhile the join is being handled: the janitor takes no such trainer for a stranger."""
    handled = []

    class SlowPeers:
        def trainer_joined(self, request, step) -> None:
            handled.append(set(endpoint.membership.handling))
            time.sleep(0.3)

        def join_info(self) -> dict:
            return {}

    endpoint.group = SlowPeers()  # type: ignore[assignment]
    t0 = time.monotonic()
    assert "error" not in join(endpoint, "trainer_0_1", step="pushpull")
    assert endpoint.membership.members["trainer_0_1"].last_seen_mono >= t0 + 0.3
    assert handled == [{"trainer_0_1"}] and endpoint.membership.handling == set()


def test_a_trainer_evicted_while_its_join_finishes_is_refused(endpoint):
    members = endpoint.membership

    class EvictingPeers:
        def trainer_joined(self, request, step) -> None:
            members.evict(request.name, "missed heartbeats")

        def join_info(self) -> dict:
            return {}

    endpoint.group = EvictingPeers()  # type: ignore[assignment]
    assert "is not a member of this psserver" in join(endpoint, "trainer_0_1", step="pushpull")["error"]


@pytest.mark.timeout(30)
def test_wait_idle_counts_calls_in_flight(endpoint):
    join(endpoint, "trainer_0_1")
    gate = threading.Event()
    half = endpoint.halves["chained"]
    real = half.evaluate
    half.evaluate = lambda trainer, x: (gate.wait(10), real(trainer, x))[1]  # type: ignore[method-assign]
    th = threading.Thread(target=endpoint.call, args=("trainer_0_1", "evaluate", (torch.randn(1, 1, 28, 28),), None))
    th.start()
    time.sleep(0.1)
    assert endpoint.wait_idle(0.05) == 1
    gate.set()
    th.join(10)
    assert endpoint.wait_idle(5) == 0



def test_a_non_finite_gradient_is_dropped_told_and_its_sender_evicted_at_the_limit(endpoint):
    """Chained steps on batches with NaN in them: their gradients are never applied, each reply
    says so; after ``--max-nonfinite-steps`` in a row the trainer is evicted with a reason."""
    join(endpoint, "trainer_0_1")
    engine = endpoint.engine
    before = [p.detach().clone() for p in engine.params]
    bad = torch.full((4, 1, 28, 28), float("nan"))
    out, notices, _ = endpoint.call("trainer_0_1", "step", (None, bad), None)  # forward of step 1
    limit = engine.config.max_nonfinite_steps
    for i in range(1, limit + 1):
        # Backward and update of step i (its gradient is NaN), forward of step i + 1.
        out, notices, _ = endpoint.call("trainer_0_1", "step", (torch.ones_like(out), bad), None)
        assert len(notices) == (1 if i < limit else 2), notices
        assert "dropped a step" in notices[0] and f"{i} non-finite in a row" in notices[0]
    assert "evicted by the server: sent 3 non-finite gradients in a row" in notices[-1]
    assert endpoint.membership.evicted.wait(5)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.params, strict=True))
    assert engine.global_step == 0 and engine.guard.nonfinite_total == limit
    assert engine.guard.counts("trainer_0_1").nonfinite == limit


def test_a_step_opened_by_a_call_whose_trainer_was_evicted_meanwhile_is_dropped(endpoint):
    """A call that waits (sync, ssp) while its trainer is evicted opens its step after the
    eviction cleaned up: the endpoint drops it, or a draining server would wait for it."""
    join(endpoint, "trainer_0_1")
    half = endpoint.halves["chained"]
    real = half.step

    def evicted_while_waiting(trainer, grad_out, x):
        endpoint.membership.members.pop(trainer)  # the eviction lands while the call waits
        return real(trainer, grad_out, x)

    half.step = evicted_while_waiting  # type: ignore[method-assign]
    endpoint.call("trainer_0_1", "step", (None, torch.randn(2, 1, 28, 28)), None)
    assert endpoint.engine.wait_idle(0.1) == [] and half.pending() == 0


def test_a_first_trainers_model_over_max_model_bytes_is_refused_before_anything_is_allocated():
    """A stride-0 tensor declares gigabytes in a few bytes on the wire: the layout's size is
    weighed against --max-model-bytes before a value is materialised, and the model is not taken."""
    cfg = ServerConfig(devices=["cpu"], optimizer=OptimizerConfig(), max_model_bytes=4096)
    engine = StepEngine(cfg, resolve_devices(cfg.devices))
    try:
        ep = Endpoint(cfg, engine, {name: half(engine) for name, half in HALVES.items()}, after_call=lambda: None)
        ep.open(Members())  # type: ignore[arg-type]
        request = join_request(0, "trainer_0_6", values=True)
        huge = [torch.zeros(1).expand(500_000_000), *request.values[1:]]
        layout = dict(request.layout, entries=[[request.layout["entries"][0][0], [500_000_000],
                                                *request.layout["entries"][0][2:]], *request.layout["entries"][1:]])
        refusal = ep.join(dataclasses.replace(request, layout=layout, values=huge))
        error = refusal["error"]
        assert "2,000,137,768 bytes" in error and "over the server's --max-model-bytes 4,096" in error
        assert not engine.has_model
        # The real model (mlp is bigger than 4 KB too): a larger --max-model-bytes takes it.
        assert "--max-model-bytes" in ep.join(join_request(0, "trainer_0_7", values=True))["error"]
    finally:
        engine.close()


def test_where_a_trainer_stopped_is_kept_only_from_a_plain_report_of_an_unfinished_run():
    at = Report(37, 2368, 0.5, 10.0, epoch=1, epoch_samples=320, batch_idx=5)
    assert stopped_at(at) == {"epoch": 1, "epoch_samples": 320, "batch_idx": 5, "steps": 37, "samples": 2368}
    assert stopped_at(dataclasses.replace(at, finished=True)) is None
    assert stopped_at(Report(0, 0, 0.0, 0.0)) is None  # never stepped: nothing to continue
    for bad in ({"epoch": "1"}, {"epoch_samples": -5}, {"batch_idx": 2 ** 60}, {"finished": "no"},
                {"epoch": True}):
        assert stopped_at(dataclasses.replace(at, **bad)) is None, bad


def test_a_malformed_join_is_one_warning_line_and_a_refusal(endpoint, caplog):
    """A forged first join whose values were an int put a 19-line traceback in the server's
    log: every field is checked before any use, and what lies inside them is refused alike."""
    good = join_request(0, "trainer_0_1", step="pushpull", compute=None)
    for change, says in (({"values": 5}, "its values is a int"), ({"rank": "0"}, "its rank is a str"),
                         ({"rank": True}, "its rank is a bool"), ({"layout": [1]}, "its layout is a list"),
                         ({"steps": -1}, "out of range"), ({"name": "x" * 2000}, "at most 1024 printable characters"),
                         ({"name": "psserver"}, "is not a trainer's of rank 0"),
                         ({"name": "trainer_1_1"}, "is not a trainer's of rank 0"),
                         ({"transport": "bogus"}, "its transport 'bogus' is not one of")):
        reply = endpoint.join(dataclasses.replace(good, **change))
        assert reply["error"].startswith("malformed join request: ") and says in reply["error"], reply
    assert endpoint.join({"rank": 0})["error"] == "malformed join request: it is a dict"
    reply = endpoint.join(dataclasses.replace(good, values=[1, 2], optimizer={"nope": 1}))  # inside a field
    assert "error" in reply and not endpoint.membership.members
    assert all(r.levelname == "WARNING" and "Traceback" not in r.getMessage() and not r.exc_info
               for r in caplog.records if r.name.startswith("psserver")), caplog.text


def test_a_refused_first_join_leaves_a_server_without_a_model_without_one(caplog):
    """A forged first join whose model arguments were nested 3,000 deep was refused, but its
    model was taken first: every later join then failed to pickle its reply (RecursionError),
    the server unusable until restarted. Whatever refuses a join is checked before the model
    is taken; a model's arguments, a host, a compute mode no trainer sends are refusals."""
    cfg = ServerConfig(model=None, devices=["cpu"], optimizer=OptimizerConfig(), update="sync", sync_trainers=2)
    engine = StepEngine(cfg, resolve_devices(cfg.devices))
    ep = Endpoint(cfg, engine, {name: half(engine) for name, half in HALVES.items()}, after_call=lambda: None)
    ep.open(Members())  # type: ignore[arg-type]
    try:
        deep: dict = {}
        for _ in range(3000):
            deep = {"k": deep}
        first = join_request(0, "trainer_0_1", step="pushpull", compute=None, values=True)
        for change, says in (({"model_args": deep}, "model_args is nested more than 16 deep"),
                             ({"model_args": {"trainer_0_2": b"xx"}}, "model_args is not plain JSON data"),
                             ({"compute": "gpu"}, "its compute is 'gpu'"),
                             ({"host": "vm\n2026 ERROR forged"}, "its host is not one line"),
                             ({"optimizer": {"name": "adam", "nope": 1}}, "malformed join request"),
                             ({"optimizer": {"name": "sgd"}}, "this server trains with adam"),
                             ({"overlap": "on"}, "--overlap on: not with sync mode")):
            reply = ep.join(dataclasses.replace(first, **change))
            assert says in reply.get("error", ""), (change, reply)
            assert not engine.has_model, change
        assert "error" not in ep.join(first) and engine.has_model
        assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    finally:
        engine.close()
