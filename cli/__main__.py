"""`python -m baton.cli`: the `baton` command (how `baton up` starts its processes)."""
import sys

from baton.cli import main

sys.exit(main())
