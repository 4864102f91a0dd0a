"""Parallelism, one module per concern: the degrees and the mesh (dims), FSDP/HSDP with gradient sync (fsdp),
tensor parallelism (tp), activation checkpointing (ac) and compile (compile). model_builder applies them in the
order TP, AC, compile, FSDP."""
