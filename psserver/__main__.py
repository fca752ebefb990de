import sys

from psserver.cli import main

sys.exit(main())
