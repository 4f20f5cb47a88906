"""Everything that crosses a process boundary, one home each (torch-free).

- `config`: the typed config tree every process reads (schema, defaults, validation, `load`);
- `plan`: what runs where (`plan.json`, computed once by the launcher, executed by everyone);
- `paths`: names in the run directory and on node-local disk, exit codes;
- `records`: the small JSON records roles leave in the run directory (resume state, role, server,
  router and exit records);
- `batch`: the rollout batch format between orchestrator and trainer.

The launcher and every role import these modules; no role imports another role's modules
(tests/unit/test_contract.py checks the import directions).
"""
