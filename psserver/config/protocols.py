"""The step protocols a parameter-server trainer and its server speak: where a step's forward
and backward run (``--compute``) and how a step crosses (``--step``), named for both sides'
configurations (``psserver.config.server``, ``psserver.config.trainer``)."""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE_MODES: dict[str, str] = {
    "trainer": "the trainer runs forward and backward on parameters it pulls; the server applies the "
               "gradient (default: adding trainers adds throughput)",
    "server": "the server runs the model on its devices; trainers feed it batches",
}
"""Where a step's forward and backward run, the default first."""


@dataclass(frozen=True)
class StepMode:
    compute: str
    """The ``COMPUTE_MODES`` entry this protocol implements."""
    help: str
    """The line ``--help`` shows."""


STEP_MODES: dict[str, StepMode] = {
    "pushpull": StepMode("trainer", "the flat gradient of step t goes up and the flat parameters of step t+1 "
                                    "come down in one RPC (1 round trip; trainer compute's default)"),
    "pull": StepMode("trainer", "the trainer pulls the parameters inside dist_autograd; dist_autograd.backward "
                                "and DistributedOptimizer.step apply the gradient on the server (3; the reference)"),
    "diloco": StepMode("trainer", "local steps with the trainer's own inner optimizer; every H steps the "
                                  "pseudo-gradient goes up and the new global weights come down in one RPC "
                                  "(servers of --update diloco)"),
    "chained": StepMode("server", "the last step's output gradient and the next batch in one RPC "
                                  "(1 round trip; server compute's default)"),
    "plain": StepMode("server", "forward RPC + dist_autograd.backward + DistributedOptimizer.step (3)"),
}
"""Step protocols (``psserver.server.steps``, one module each), each for one compute mode, the
default of each mode first. Adding a protocol: its module and its entry here."""


COMPUTE_HELP = ("ps mode, where forward and backward run (default: the server's pin, else trainer): "
                + "; ".join(f"{name} = {line}" for name, line in COMPUTE_MODES.items()))
STEP_HELP = ("ps mode, how a step crosses (default: the first of its --compute): "
             + "; ".join(f"{name} = [{mode.compute}] {mode.help}" for name, mode in STEP_MODES.items()))


def default_step(compute: str) -> str:
    """The step protocol a trainer speaks when it names only where it computes."""
    return next(name for name, mode in STEP_MODES.items() if mode.compute == compute)


def check_compute(compute: str | None, flag: str = "--compute") -> None:
    if compute is not None and compute not in COMPUTE_MODES:
        raise ValueError(f"{flag} must be one of {', '.join(COMPUTE_MODES)}, got {compute!r}")
