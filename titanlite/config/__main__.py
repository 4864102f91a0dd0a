"""`python -m titanlite.config`: see titanlite.cli.check_config."""

from titanlite.cli.check_config import main

raise SystemExit(main())
