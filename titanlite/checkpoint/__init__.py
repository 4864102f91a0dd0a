"""Checkpoints: the folder catalogue and start-up checks (`catalog`), the saved parts (`parts`), the
manager that saves and resumes (`manager`), and consolidated export/import (`consolidated`).

`python -m titanlite.checkpoint export ...` is titanlite.cli.checkpoint.
"""
