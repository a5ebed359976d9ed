"""``python -m examples.rl_loop``: see main.py."""

import sys

from .main import main

sys.exit(main())
