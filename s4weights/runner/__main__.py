import sys

from s4weights.runner.cli import main

sys.exit(main())
