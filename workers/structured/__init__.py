"""Structured outputs: grammar specs, the grammar backend, per-request matchers and the
compile pool (docs/architecture.md, "Structured outputs")."""
