"""`python -m p2p_diloco` runs the CLI."""

import sys

from p2p_diloco.cli.main import main

sys.exit(main())
