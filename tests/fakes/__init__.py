"""Fake Azure services (Batch, Files, ARM/ACR Tasks, the registry) for the SDK contract tests.

Responses follow the REST shapes of the official API specs and examples; every request the SDK
sends is recorded with its decoded body so tests assert on what went over the wire.
"""
