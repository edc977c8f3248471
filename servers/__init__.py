"""The orchestrator's HTTP servers: the outputs gateway and the Event Grid relay."""
