"""`python -m weightclient` runs the `weightserver` console script (see weightclient.command_line)."""

import sys

from weightclient.command_line import main

sys.exit(main())
