"""Test and benchmark harness, shared by tests/ and benchmarks/ (production code imports none of it).

- ``servers``: launch the project's own services (``python -m draft_service``, ``target_service``,
  ``orchestrator front``) as subprocesses on loopback ports, wait for their ready line, stop them.
- ``otlp``: an in-memory OTLP/gRPC trace receiver that those processes export their spans to.

Helpers that only tests use (tiny saved models, test configs) stay in tests/.
"""
