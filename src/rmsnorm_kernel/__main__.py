import sys

from rmsnorm_kernel.cli import main

sys.exit(main())
