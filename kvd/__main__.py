"""`python -m kvd` is the `kvd` command."""

import sys

from kvd.cli import main

sys.exit(main())
