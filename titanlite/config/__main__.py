"""`python -m titanlite.config`: see titanlite.cli.check_config."""

from titanlite.runtime import early_stop

early_stop.install()  # run_train.sh's pre-check: a Ctrl-C during its imports is a quiet exit, not a traceback

from titanlite.cli.check_config import main  # noqa: E402

raise SystemExit(main())
