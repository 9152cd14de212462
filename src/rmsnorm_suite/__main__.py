import sys

from rmsnorm_suite.cli import main

sys.exit(main())
