"""`python -m specserve`: the `specserve` command."""

import sys

from specserve.cli import main

sys.exit(main())
