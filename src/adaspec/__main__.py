import sys

from adaspec.cli import main

sys.exit(main())
