"""`python -m minillm.cli ...` is the `minillm` command (bench serve starts its server this way)."""

import sys

from minillm.cli import main

sys.exit(main())
