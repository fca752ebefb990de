"""Every way of training one model in one run: local loops, PS, DDP and FSDP, a one-window pass
then paired rounds (``run``), and its report (``report``): ``python -m benchmarks.run``."""
