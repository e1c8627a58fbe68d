"""`python -m mmrl` (and `accelerate launch -m mmrl train ...`)."""

import sys

from mmrl.cli import main

sys.exit(main())
