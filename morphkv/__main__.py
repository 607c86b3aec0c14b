"""``python -m morphkv``."""

import sys

from morphkv.cli import main

if __name__ == "__main__":
    sys.exit(main())
