import sys

from multigpu.cli import main

sys.exit(main())
