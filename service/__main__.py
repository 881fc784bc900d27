"""``python -m service`` is ``crs-consumer``."""

import sys

from service.app.cli import main

sys.exit(main())
