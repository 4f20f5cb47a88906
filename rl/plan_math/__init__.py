"""The torch-free arithmetic of a plan: the model's shape and parameter counts (`shape`), the trainer's
activations (`activations`) and what every GPU holds (`memory`).

These were launch/shape.py, launch/activations.py and launch/memory.py. They moved here, below both
the launcher and the tools, because `python -m rl.doctor` (a child process of `launch doctor`) checks a
real trainer step against the same estimate `launch plan` prints: with the estimate in launch/, a tool
of rl/ imported the launcher. Now `launch` and `rl.doctor` both import down into this package, and it
imports only the standard library, rl.contract and the torch-free rows of the network: each family's
`rl.models.<package>.args` (by name, from the family's row) built of rl.models.layers' per-kind
calculators, which these modules sum over without naming a family or a kind. `launch.shape`,
`launch.activations` and `launch.memory` remain as names of these modules for the launcher's own code.
"""
