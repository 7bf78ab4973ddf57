"""`expertstream bench`: speed against the machine's physical limits (docs/benchmarks.md)."""
