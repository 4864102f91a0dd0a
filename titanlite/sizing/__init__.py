"""Sizing a job without running it: the dry run's report, pipeline sizing, the memory estimate and FLOPs."""
