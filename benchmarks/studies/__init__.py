"""Studies built on the harness, one module (or subpackage) each, run through the one CLI:
``python -m benchmarks STUDY [flags]`` (``python -m benchmarks --help`` lists them)."""
