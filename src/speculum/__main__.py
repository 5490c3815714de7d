import sys

from speculum.cli import main

sys.exit(main())
