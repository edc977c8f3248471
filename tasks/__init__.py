"""Prefect tasks, one module per pipeline step. Thin: each calls a backend and reports."""
