import sys

from s4format.cli import main

sys.exit(main())
