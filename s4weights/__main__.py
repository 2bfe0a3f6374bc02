import sys

from s4weights.cli import main

sys.exit(main())
