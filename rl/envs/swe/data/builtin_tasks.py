"""The built-in SWE tasks as source: each a tiny repository (`files`, with its visible tests), an issue
text, the fix as (path, old, new) replacements, and the hidden tests as new test files.
`make_builtin.py` turns them into `builtin.jsonl` (diffs computed, test outcomes measured).

The tasks live in three modules of data (builtin_tasks_a.py, _b.py, _c.py), written with
`task_source.T`; their order here is the order of `builtin.jsonl`.
"""
from __future__ import annotations

from rl.envs.swe.data import builtin_tasks_a, builtin_tasks_b, builtin_tasks_c

TASKS = builtin_tasks_a.TASKS + builtin_tasks_b.TASKS + builtin_tasks_c.TASKS
