"""Test and benchmark harness, shared by tests/ and benchmarks/ (production code imports none of it); its modules are
listed in docs/design.md and tests/README.md. In-memory tiny models and test-only fixtures stay in tests/conftest.py.
"""
