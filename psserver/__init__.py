"""psserver: a parameter-server service for PyTorch."""

__version__ = "0.1.0"
