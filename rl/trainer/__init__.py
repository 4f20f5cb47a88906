"""The trainer role: the model of `model.family` built from rl/models (`model`), the RL loss (`loss`),
checkpoints (`checkpoint`), a start from an HF checkpoint (`hf_load`) and the role's loop (`train.run`,
`python -m rl.trainer --run-dir D`); multi-rank FSDP x EP x CP (`parallel`, launched by
`python -m rl.trainer.torchrun ...`) and block-scaled FP8 training (`fp8`). The networks, their CPU
workarounds and the replaying router live in rl/models (rl.models.cpu, rl.models.replay).

Importing this package imports no torch; the submodules do.
"""
