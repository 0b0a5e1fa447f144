"""``python -m roundpipe``: the ``roundpipe`` command line (see ``roundpipe.cli``)."""

import sys

from roundpipe.cli import main

sys.exit(main())
