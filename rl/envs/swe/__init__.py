"""SWE environment: sandboxed episodes on small repositories (sandbox.py), SWE-bench-format tasks and
their grading (tasks.py), the agent's tools (tools.py) and the episode API (env.py). No torch or vLLM."""
