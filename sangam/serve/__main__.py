import sys

from sangam.serve.server import main

sys.exit(main())
