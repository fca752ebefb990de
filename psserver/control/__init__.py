"""gRPC control plane: see and steer a running psserver (status, watch, trainers, checkpoint,
shutdown, health).

``server.ControlServer`` serves a :class:`psserver.telemetry.ControlTarget`;
``client.ControlClient`` is what ``psserver status|checkpoint|stop`` and tests use. The wire
format is ``protos/psserver/v1/control.proto``; its stubs live in ``psserver.control.v1``.
"""

SERVICE_NAME = "psserver.v1.ControlService"
WEIGHTS_SERVICE_NAME = "psserver.v1.WeightsService"
DEFAULT_ADDRESS = "127.0.0.1:50051"
ADDRESS_ENV = "PSSERVER_CONTROL_ADDRESS"
