"""Built-in SWE tasks (builtin.jsonl) and the script that writes them (make_builtin.py)."""
