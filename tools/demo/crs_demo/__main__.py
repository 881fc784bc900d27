import sys

from crs_demo.cli import main

sys.exit(main())
