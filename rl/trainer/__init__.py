"""The trainer role: the model of `model.family` built from rl/models (`model`), the RL loss (`loss`),
checkpoints (`checkpoint`), a start from an HF checkpoint (`hf_load`), the Trainer (`train`: model,
optimizer, one step, publishing its weights), packing batches into micro-batches (`packing`) and the
role: start-up and assets (`startup`), the step loop (`loop.run`, `python -m rl.trainer --run-dir D`) and
the end-of-step bookkeeping (`bookkeeping`: publishing, pruning, the final sweep); multi-rank FSDP x EP x CP (`parallel`, launched by
`python -m rl.trainer.torchrun ...`) and block-scaled FP8 training (`fp8`). The networks, their CPU
workarounds and the replaying router live in rl/models (rl.models.cpu, rl.models.replay).

Importing this package imports no torch; the submodules do.
"""
