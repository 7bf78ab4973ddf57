import sys

from expertstream.cli import main

sys.exit(main())
