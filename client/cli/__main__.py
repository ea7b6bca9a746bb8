"""``python -m client.cli``: the same as the ``specdraft`` command."""

import sys

from client.cli import main

sys.exit(main())
