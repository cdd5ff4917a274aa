import sys

from edgeproxy._cli import main

sys.exit(main())
