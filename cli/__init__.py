"""The orchestrator's command lines that are not flows: models, data."""
