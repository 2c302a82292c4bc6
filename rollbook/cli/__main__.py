"""``python -m rollbook.cli ...``: the ``rollbook`` command."""

import sys

from rollbook.cli.main import main

sys.exit(main())
