"""Collective training, the alternative to the parameter server: ``psserver train --mode ddp|fsdp``.

- ``cli_args``: flags and the entry point of the train command;
- ``launcher``: torchrun's environment or our own spawn, process group set up and torn down;
- ``base``/``ddp``/``fsdp``: strategies by name (DDP with communication hooks; FSDP2 with
  optional tensor parallelism on a 2-D mesh), ``hooks``: DDP communication hooks;
- ``loop``: the training loop, ``checkpoint``: sharded DCP checkpoints, ``status``: the
  control-plane view of rank 0.
"""
