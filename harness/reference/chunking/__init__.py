"""Chunking of MoE regions so that one chunk's token exchange overlaps another chunk's compute."""

# The deliberate bugs a graph arm can carry, each breaking one pass (chunking/graph_step.py plants them),
# so that the harness can prove its checks catch them. Here, apart from the passes: validating a
# config must not import the tracing machinery.
FAULTS = ("none", "skip-buffer-pass", "drop-wait", "forward-order-backward", "clone-forward-only")
