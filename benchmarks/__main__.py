"""The one command line of the benchmarks: ``python -m benchmarks STUDY [flags]`` runs a study
(``python -m benchmarks STUDY --help`` for its flags), ``python -m benchmarks tables`` makes every
results table again from its committed JSON."""

from __future__ import annotations

import importlib
import sys

STUDIES = {
    "throughput": ("benchmarks.studies.throughput.run",
                   "local loops, PS, DDP and FSDP in one run, then paired rounds (python -m benchmarks.run)"),
    "paired": ("benchmarks.harness.paired", "paired rounds of chosen setups (python -m benchmarks.paired)"),
    "data_loading": ("benchmarks.studies.data_loading", "a user's Dataset through the DataLoader against in memory"),
    "servers_scaling": ("benchmarks.studies.servers_scaling", "several server processes across rate-limited links"),
    "diloco": ("benchmarks.studies.diloco", "DDP, pushpull and DiLoCo over slow links to a target loss"),
    "embedding_tables": ("benchmarks.studies.embedding.tables", "embedding tables across hosts: bytes and rates"),
    "state_copy": ("benchmarks.studies.state_copy", "what a host copy of the state per update would cost"),
    "restart": ("benchmarks.studies.restart", "a server SIGKILLed under --supervise: time back to serving"),
    "model_join": ("benchmarks.studies.model_join", "the first join to a server started without --model"),
    "readers": ("benchmarks.studies.readers", "readers of the weights while training: freshness, cost to training"),
    "allowlist_cost": ("benchmarks.studies.allowlist_cost", "what the RPC allow-list check costs per call"),
    "omp_teams": ("benchmarks.studies.omp_teams", "one OpenMP team against several in one process"),
    "server_half": ("benchmarks.studies.server_half", "the server's half of a step, in process"),
    "collective_overhead": ("benchmarks.harness.collective_overhead", "psserver's DDP/FSDP loop against plain torch"),
    "multihost": ("benchmarks.harness.multihost", "build hosts of network namespaces and measure a link"),
    "tables": ("benchmarks.tables", "make every table of benchmarks/results again from its JSON (--check: compare)"),
}


def usage() -> str:
    width = max(map(len, STUDIES))
    return "usage: python -m benchmarks STUDY [flags]\n\n" + "\n".join(
        f"  {name:<{width}}  {what}" for name, (_, what) in STUDIES.items()) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(usage())
        return 0 if argv else 2
    if argv[0] not in STUDIES:
        sys.stderr.write(f"python -m benchmarks: unknown study {argv[0]!r}; choose from {', '.join(STUDIES)}\n")
        return 2
    module = importlib.import_module(STUDIES[argv[0]][0])
    from benchmarks.harness.paired import exit_on_sigterm

    with exit_on_sigterm():  # every study: its ``finally`` stops what it started (a killed one leaves it running)
        return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
