import sys

from svip_cli.main import main

sys.exit(main())
