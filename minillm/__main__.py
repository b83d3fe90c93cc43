"""`python -m minillm ...` is the `minillm` command."""

import sys

from minillm.cli import main

sys.exit(main())
