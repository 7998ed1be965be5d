import sys

from tandem.cluster.cli.main import main

sys.exit(main())
