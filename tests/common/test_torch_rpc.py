"""A leave or an eviction keeps the agent's CUDA devices and the other trainers' reply maps:
torch's leave erased them all, and psserver put them back a moment later, so a CUDA message
read in between had no stream (no agent on CUDA is needed to show what a leave passes)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from psserver.common import torch_rpc

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


class Agent:
    """What ``torch_rpc`` asks of a TensorPipe agent: each membership update it is given, kept."""

    def __init__(self) -> None:
        self.updates: list[tuple[str, list, dict, bool]] = []

    def _get_backend_options(self):
        return SimpleNamespace(devices=[CUDA0])

    def get_worker_info(self):
        return SimpleNamespace(name="psserver", id=0)

    def _update_group_membership(self, info, devices, maps, is_join):
        self.updates.append((info.name, list(devices), {k: dict(v) for k, v in maps.items()}, is_join))


def test_a_leave_never_erases_the_devices_or_another_trainers_reply_map(monkeypatch):
    agent = Agent()
    monkeypatch.setattr(torch_rpc, "agent_is_set", lambda: True)
    monkeypatch.setattr(torch_rpc, "current_agent", lambda: agent)
    monkeypatch.setattr(torch_rpc, "_reply_maps", {})
    torch_rpc.map_replies("trainer_0_1", {CUDA0: CUDA0})
    torch_rpc.map_replies("trainer_1_1", {CUDA0: CUDA1})
    agent.updates.clear()
    leaving = SimpleNamespace(name="trainer_1_1", id=2)
    torch_rpc.update_group_membership(leaving, [], {}, False)  # what torch's leave sends every member
    torch_rpc.remove_worker(agent, leaving)  # an eviction
    leaves = [u for u in agent.updates if not u[3]]
    assert len(leaves) == 2
    for name, devices, maps, _ in leaves:
        assert name == "trainer_1_1" and devices == [CUDA0]
        assert maps == {"trainer_0_1": {CUDA0: CUDA0}}  # every map but the leaver's
    assert all(devices for _, devices, _, _ in agent.updates)  # no update ever passes no device
