"""The trainer role: torchtitan Qwen3-MoE (`model`), CPU workarounds (`cpu`), the RL loss (`loss`),
checkpoints (`checkpoint`) and the role's loop (`train.run`, `python -m rl.trainer --run-dir D`);
multi-rank FSDP x EP x CP (`parallel`, launched by `python -m rl.trainer.torchrun ...`), router replay
(`replay`) and block-scaled FP8 training (`fp8`).

Importing this package imports no torch; the submodules do.
"""
