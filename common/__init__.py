"""Small helpers the orchestrator and the nodes share (atomic writes, checksums)."""
