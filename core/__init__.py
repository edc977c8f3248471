"""What every layer of the orchestrator shares: the config schema, a run's names and paths,
the pool's concurrency slot. Imports no other package of the project's orchestrator side."""
