"""The trainer role: torchtitan Qwen3-MoE (`model`), CPU workarounds (`cpu`), the RL loss (`loss`),
checkpoints (`checkpoint`) and the role's loop (`train.run`, `python -m rl.trainer --run-dir D`).

Importing this package imports no torch; the submodules do.
"""
