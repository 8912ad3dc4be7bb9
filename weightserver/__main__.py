"""`python -m weightserver`: the `weightserver` console script."""

from weightserver.cli import main

raise SystemExit(main())
