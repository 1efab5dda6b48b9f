"""`python -m p2p_diloco.cli`: the same as `p2p-diloco`."""

import sys

from p2p_diloco.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
