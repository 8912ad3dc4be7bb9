"""`python -m weightserver` runs the server's command line, `serve` (see weightserver.cli)."""

import sys

from weightserver.cli import main

sys.exit(main())
