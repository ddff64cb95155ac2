"""`python -m tidepool` runs the console script."""

import sys

from tidepool.cli import main

sys.exit(main())
