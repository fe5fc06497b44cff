import sys

from powersgd_triton.cli import main

sys.exit(main())
