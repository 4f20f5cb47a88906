"""The run-directory protocol: how every producer hands data to every consumer.

All hand-offs (rollout batches, weight shards, checkpoints) go through the shared filesystem as
step-versioned directories, `RUN_DIR/<kind>/step_000042/`, published atomically (write privately, fsync,
manifest last, rename into place) so a directory named `step_N` is complete by construction; readers
verify sizes and, before training on or loading the data, checksums: a corrupted or truncated file raises
`CorruptStep` and is never consumed. Consumers record what they consumed in `<kind>/consumed.jsonl` so
retention never deletes a step a consumer still needs and a resumed consumer never takes a step twice.

The protocol lives in modules of its own (this `__init__` was one module of 720 lines; issue 23):
- `rl.exchange.files`: reading a step's files without following links (`open_in_step`, `CorruptStep`);
- `rl.exchange.fencing`: incarnations and fencing (a stale process never publishes);
- `rl.exchange.steps`: publish / commit / verify / list / set aside / retire steps, the consumed log,
  delta chains;
- `rl.exchange.jsonl`: append-only JSON-lines records;
- `rl.exchange.layout`: the files of a weights step, which tensors go FP8, and `quant_holder` (where a
  config.json keeps the `quantization_config` vLLM reads).
The weights (`shards`, `shard_reader`, `deltas`, `weights`, `publisher`, `layout`) and the retention of
old steps (`retention`) build on them. This `__init__` only gathers the public names, so that callers
keep writing `from rl import exchange; exchange.verify(...)`; no module of the package imports it back
(each imports the module that defines what it uses), so it cannot close a circle.

Nothing here imports torch: the launcher and the tests use it freely.
"""
from __future__ import annotations

from rl.exchange.fencing import (INCARNATIONS, RESUME, Fenced, Incarnation, check_fence, fence, incarnation,
                                 record_incarnation)
from rl.exchange.files import (MANIFEST, CorruptStep, open_in_step, read_in_step, read_regular, rel_ok, sha256_fd,
                               sha256_file, step_dir, step_name)
from rl.exchange.jsonl import append_jsonl, read_jsonl
from rl.exchange.layout import quant_holder
from rl.exchange.steps import (DELTA, MAX_DELTA_CHAIN, ConsumedLog, Published, begin, clean_tmp, commit,
                               delta_base, delta_chain, discard_after, latest_complete, list_steps, parse_delta,
                               publish, read_manifest, restore_asides, set_aside, verify, wait_for)

__all__ = [
    "INCARNATIONS", "RESUME", "Fenced", "Incarnation", "check_fence", "fence", "incarnation", "record_incarnation",
    "MANIFEST", "CorruptStep", "open_in_step", "read_in_step", "read_regular", "rel_ok", "sha256_fd", "sha256_file",
    "step_dir", "step_name", "append_jsonl", "read_jsonl", "quant_holder",
    "DELTA", "MAX_DELTA_CHAIN", "ConsumedLog", "Published", "begin", "clean_tmp", "commit", "delta_base",
    "delta_chain", "discard_after", "latest_complete", "list_steps", "parse_delta", "publish", "read_manifest",
    "restore_asides", "set_aside", "verify", "wait_for",
]
