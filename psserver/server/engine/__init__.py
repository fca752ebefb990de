"""The tensor work of a server process, no RPC: the step engine, shards and their optimizers, the
updaters (async, sync, ssp), the guard, the journal of applied gradients, gradient parts, a held
model, the learning-rate schedule, the compute thread."""
