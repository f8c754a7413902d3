"""`python -m baton.bench SUITE ...`: the same as `baton bench SUITE ...`."""
import sys

from baton.bench import main

sys.exit(main())
