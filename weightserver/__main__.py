"""`python -m weightserver` runs the command line (see weightserver.cli)."""

import sys

from weightserver.cli import main

sys.exit(main())
