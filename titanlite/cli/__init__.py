"""Entry points: each module turns argv into an exit code (0 done, 1 failed, 2 a configuration error).

The `python -m titanlite.<command>` modules are thin shims over these; nothing imports an entry point.
"""
