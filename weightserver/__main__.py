"""`python -m weightserver` runs the `weightserver` console script (see weightserver.command_line)."""

import sys

from weightserver.command_line import main

sys.exit(main())
