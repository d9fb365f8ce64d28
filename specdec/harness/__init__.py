"""Test and benchmark harness, shared by tests/ and benchmarks/ (production code imports none of it).

- ``servers``: launch the project's own services (``python -m draft_service``, ``target_service``,
  ``orchestrator front``) as subprocesses on loopback ports, wait for their ready line, stop them.
- ``otlp``: an in-memory OTLP/gRPC trace receiver that those processes export their spans to.
- ``tiny_pair``: tiny seeded random-weight model pairs saved to disk with a tokenizer, and service
  config files for them (the tests' and the reliability benchmarks' deployments; no downloads).
- ``pki``: a throwaway CA and a certificate it signed (TLS between the processes).
- ``report``: benchmark records: the machine and commit, markdown tables, the JSON + markdown pair.

In-memory tiny models and test-only fixtures stay in tests/conftest.py.
"""
