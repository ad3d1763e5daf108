"""`python -m gpuguard.testhosts`: see testhosts/cli.py."""

import sys

from gpuguard.testhosts.cli import main

sys.exit(main())
