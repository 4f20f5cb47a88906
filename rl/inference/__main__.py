"""`python -m rl.inference --run-dir D [--index I]`: one policy server (see rl.inference.server)."""
import sys

from rl.inference.server import main

if __name__ == "__main__":
    sys.exit(main())
