"""`python -m titanlite.generate`: a shim over titanlite.cli.generate (nothing imports this module)."""

from titanlite.runtime import early_stop

early_stop.install()  # a Ctrl-C is a quiet exit, not a traceback

from titanlite.cli.generate import entry  # noqa: E402

if __name__ == "__main__":
    entry()
