"""Chunking of MoE regions so that one chunk's token exchange overlaps another chunk's compute."""
