"""harness: verify numerics, communication and throughput of distributed training changes."""

__version__ = "0.1.0"
