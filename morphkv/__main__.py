"""``python -m morphkv``."""

import sys

from morphkv.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
