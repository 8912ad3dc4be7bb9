"""`python -m demo`: run the actor-learner demo (see demo.run)."""

import sys

from demo.run import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
