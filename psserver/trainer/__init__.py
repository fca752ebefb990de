"""The trainer's side of psserver, a library first: :func:`~psserver.trainer.library.connect`
and its :class:`~psserver.trainer.connection.Connection`, this process's membership, which steps
one of three ways, each an object of its own: a :class:`~psserver.trainer.replica.Replica` (a
user's own loop, ``ps.replica(model)`` and ``ps.step()``; Horovod's wrapper,
:class:`~psserver.trainer.optimizer.DistributedOptimizer`, over it), a
:class:`~psserver.trainer.remote_model.RemoteModel` (PyTorch's RPC tutorial loop,
``ps.parameter_rrefs()`` and ``ps.forward(x)``), or :class:`~psserver.trainer.model_steps.ModelSteps`
(``psserver train``'s own loop, ``psserver.trainer.loop``: ``ps.join()`` and ``train_step``).

- ``session``: one membership of the server's RPC group (join, heartbeat, leave, the channel
  the step protocols' trainer halves call through);
- ``recovery``: a failed call diagnosed, the rejoin; ``rejoin``: the re-executed process image;
- ``stop_signals``: SIGTERM and SIGINT leave after the step in flight.
"""
