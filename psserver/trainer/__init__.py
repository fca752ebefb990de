"""The trainer's side of psserver, a library first: :func:`~psserver.trainer.connection.connect`
and its :class:`~psserver.trainer.connection.Connection` (a user's own loop),
:class:`~psserver.trainer.optimizer.DistributedOptimizer` (Horovod's wrapper), and
``psserver train``'s own loop on the same session (``psserver.trainer.loop``).

- ``session``: one membership of the server's RPC group (join, heartbeat, leave, the channel
  the step protocols' trainer halves call through);
- ``recovery``: a failed call diagnosed, the rejoin; ``rejoin``: the re-executed process image;
- ``stop_signals``: SIGTERM and SIGINT leave after the step in flight.
"""
