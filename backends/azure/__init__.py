"""The Azure target: Files, Batch and ACR through the current SDKs (imported lazily)."""

from typing import Any


def service_name(value: Any) -> str:
    """An SDK enum as the service spells it ("unusable", not "BatchNodeState.UNUSABLE")."""
    return str(getattr(value, "value", value))
