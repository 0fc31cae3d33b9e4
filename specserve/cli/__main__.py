"""`python -m specserve.cli`: the `specserve` command."""

import sys

from specserve.cli import main

sys.exit(main())
