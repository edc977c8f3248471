"""The Azure target: Files, Batch and ACR through the current SDKs (imported lazily)."""
