"""`python -m weightserver`: the `weightserver` console script."""

import sys

from weightserver.cli import main

sys.exit(main())
