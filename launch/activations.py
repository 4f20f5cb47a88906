"""`launch.activations` is rl.plan_math.activations under the launcher's name.

rl/plan_math/__init__.py says why the plan arithmetic lives there: rl.doctor reads the same estimate
without importing the launcher."""
from rl.plan_math.activations import *  # noqa: F401,F403
