import sys

from prefixflight.cli import main

sys.exit(main())
