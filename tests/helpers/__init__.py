"""Helpers that several test files share, imported as `helpers.<module>`.

A test that needs another test file's helper used to put that file's directory on sys.path first (a unit
test reaching into tests/integration for the trainer's synthetic batches, say). Now pytest puts the
repository root, tests/ and benchmarks/ on sys.path itself (`pythonpath` in setup.cfg's [tool:pytest]),
so what is shared lives here, one module per subject, and a benchmark module is imported by its name:

    helpers.trainer   a tiny trainer config and synthetic rollout batches (no vLLM, no orchestrator)
    helpers.doctor    the rows `launch doctor` reports

tests/builders.py (run directories and composed configs) and tests/slurm_cluster.py (the localhost
Slurm cluster and its fixtures) stay where they are, on the same path, imported by their names.
A process that a test starts outside pytest (a role of a stand-in batch script) gets the same by
having tests/ on its PYTHONPATH.
"""
