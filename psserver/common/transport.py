"""Which way a trainer's parameters and gradients travel, and why.

Three paths, best first:

- ``device-map``: the trainer's model and the server's shard are on CUDA devices of one host.
  The trainer joins the RPC group with a TensorPipe device map (its device to the shard's), and
  both sides send their flat buffers as CUDA tensors: TensorPipe moves them device to device
  over CUDA IPC. Where its ``cuda_ipc`` channel is not viable between the two GPUs, TensorPipe
  takes ``cuda_basic``, which copies through host memory, and says nothing: the reason below
  says so, and the paired benchmark shows it as time. Where IPC is viable but refused when used
  (containers without a shared IPC namespace), the probe fails and the trainer goes ``staged``
  (in a fresh process when the failure broke its pipe). TensorPipe pays per CUDA tensor, so a
  step sends one flat buffer per shard, never one tensor per parameter.
- ``staged``: the trainer is on CUDA but the device map cannot be used (the server is on another
  host, on the CPU, spread over several devices or processes; or ``--transport staged``). The
  trainer copies its gradient into pinned host memory on a side stream and sends that.
- ``cpu``: the trainer runs on the CPU: host memory is where the tensors are.

Pure decisions, no RPC: the session asks before it joins, the server records the answer each
trainer reports, and ``psserver status`` shows it, so a slow fallback is never silent.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

from psserver.errors import UsageError
from psserver.utils.processes import boot_id

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtypes parameters and gradients may travel in (``--wire-dtype``); the server keeps fp32."""


@dataclass(frozen=True)
class TransportPath:
    kind: str
    """``device-map``, ``staged`` or ``cpu``."""
    reason: str
    """Why this path, in words for the log and ``psserver status``."""
    server_device: str | None = None
    """The server shard's device the trainer's device maps to (``device-map`` only)."""

    @property
    def on_device(self) -> bool:
        """Whether the flat buffers cross as CUDA tensors (the RPC agent needs a device map)."""
        return self.kind == "device-map"

    def describe(self, trainer_device: torch.device | str) -> str:
        if self.on_device:
            return f"device-map {trainer_device} -> server {self.server_device}: {self.reason}"
        return f"{self.kind}: {self.reason}"


def host_id() -> str:
    """This host as both sides can compare it: the host name and the kernel's boot id (two
    containers of one host share the boot id but not always the name; two hosts never share both)."""
    return f"{socket.gethostname()}/{boot_id() or ''}"


def choose_path(requested: str, trainer_device: torch.device, server: dict, failed: str | None = None) -> TransportPath:
    """The path for a trainer on ``trainer_device`` to the server described by ``server`` (what
    it published: ``devices``, ``num_servers``, ``host_id``); ``requested`` is ``--transport`` as
    ``TrainerConfig`` checked it (a known path; a GPU one only for a GPU trainer). ``UsageError``
    when the device map asked for by name cannot be used. ``failed``: why a device map failed
    this rank's last process image, which made it join again: ``staged`` instead."""
    if trainer_device.type != "cuda":
        return TransportPath("cpu", "the trainer runs on the CPU")
    if requested == "cpu":
        return TransportPath("cpu", "--transport cpu: through pageable host memory, as a CPU trainer")
    if requested == "staged":
        return TransportPath("staged", "--transport staged: through pinned host memory")
    why_not = _device_map_refusal(server)
    if why_not is None and failed is not None:
        return TransportPath("staged", f"the device map failed its probe ({failed}), so through pinned host memory")
    if why_not is None:
        return TransportPath("device-map", "both on CUDA on one host: device to device over CUDA IPC "
                             "(TensorPipe copies through host memory where IPC is not viable)",
                             server["devices"][0])
    if requested == "device-map":
        raise UsageError(f"--transport device-map cannot be used: {why_not}")
    return TransportPath("staged", f"{why_not}, so through pinned host memory")


def _device_map_refusal(server: dict) -> str | None:
    """Why a device map to this server cannot be used (None: it can)."""
    devices = server.get("devices") or []
    if int(server.get("num_servers") or 1) > 1:
        return "the model is spread over several server processes (device maps go to one)"
    if len(devices) != 1:
        return f"the server holds the model over {len(devices)} devices" if devices else \
            "the server did not say where its model is (an older psserver?)"
    if not str(devices[0]).startswith("cuda"):
        return f"the server's model is on {devices[0]}"
    if server.get("host_id") != host_id():
        return "the server is on another host"
    return None


def device_maps(path: TransportPath, trainer_device: torch.device, server_name: str) -> dict | None:
    """The RPC agent's ``device_maps`` for ``path`` (None: CPU tensors only)."""
    if not path.on_device:
        return None
    return {server_name: {trainer_device: torch.device(path.server_device)}}
