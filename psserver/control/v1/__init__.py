"""Generated protobuf/gRPC stubs of ``protos/psserver/v1/control.proto``.

Do not edit the ``control_pb2*`` files: regenerate them with
``python -m psserver.control.codegen`` (CI runs ``--check``).
"""
