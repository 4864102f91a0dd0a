"""Parallelism, one module per kind, each owning its check (problem(cfg, dims, args, device_type) -> str | None,
looped over by plan.py), its part of the mesh and how it is applied: the degrees and every mesh (dims), FSDP/HSDP
with gradient sync (fsdp), tensor (tp), expert (ep), context (cp) and pipeline (pp) parallelism, fault-tolerant
replica groups (the ft/ folder), float8, activation checkpointing (ac) and compile. model_builder applies them in
the order float8, TP, LoRA, EP, CP, AC, compile, (pipeline split), FSDP."""
