"""Collective training, the alternative to the parameter server: ``psserver train --mode ddp|fsdp``.

- ``run``: the entry point of ``psserver train --mode ddp|fsdp`` (its flags and the
  ``CollectiveConfig`` built from them are ``psserver.cli.collective_args``);
- ``launcher``: torchrun's environment or our own spawn, process group set up and torn down;
- ``base``/``ddp``/``fsdp``: strategies by name (DDP with communication hooks; FSDP2 with
  optional tensor parallelism on a 2-D mesh, the plan from the model's spec); each strategy
  registers itself when its module is imported (``loop`` imports the built-in ones), the
  base never imports them; ``hooks``: DDP communication hooks;
- ``loop``: the training loop, ``checkpoint``: sharded DCP checkpoints, ``status``: the
  control-plane view of rank 0.
"""
