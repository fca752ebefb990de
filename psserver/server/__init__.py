"""Everything that runs in a server process, nothing a trainer imports (import-linter keeps it so).

- ``server``: one process's composition root; ``endpoint``: the handler behind the RPC surface
  (``psserver.common.calls``); ``membership``, ``admission``, ``averages``, ``status``;
- ``steps``: the server halves of the step protocols (their trainer halves:
  ``psserver.trainer.steps``, same module names);
- ``engine``: the tensor work, no RPC; ``sparse``: embedding tables; ``group``: several server
  processes; ``state``: the state in shared memory; ``checkpoints``; ``supervisor``.
"""
