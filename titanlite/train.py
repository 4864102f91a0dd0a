"""`python -m titanlite.train`: a shim over titanlite.cli.train (nothing imports this module)."""

from titanlite.runtime import early_stop

early_stop.install()  # before the heavy imports below: a stop during them is a quiet exit, not a traceback

from titanlite.cli.train import entry  # noqa: E402

if __name__ == "__main__":
    entry()
