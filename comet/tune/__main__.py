"""python -m comet.tune: see comet.tune.cli."""
import sys

from comet.tune.cli import main

sys.exit(main())
