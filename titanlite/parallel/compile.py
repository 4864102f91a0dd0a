"""torch.compile of the transformer blocks, and whether this machine can compile at all."""

from __future__ import annotations

import os

from torch import nn

from titanlite.compat import cpp_compiler_error, has_triton


def problem(cfg, dims=None, args=None, device_type: str | None = None, inference: bool = False) -> str | None:
    """Why [compile] cannot run on this machine, or None (the dry run, device_type None, does not ask)."""
    return compile_problem(cfg.compile, device_type) if device_type and not inference else None


def compile_problem(compile_cfg, device_type: str) -> str | None:
    """Why `[compile]` cannot work on this machine for `device_type`, or None when it can (or is off)."""
    if not compile_cfg.enable or compile_cfg.backend != "inductor":
        return None
    if device_type == "cpu":
        error = cpp_compiler_error()
        if error is not None:
            cxx = os.environ.get("CXX")
            found = f"CXX = {cxx!r} cannot run ({error})" if cxx else f"none was found ({type(error).__name__})"
            return (
                f"compile.enable = true with compile.backend = 'inductor' needs a C++ compiler on CPU and {found}; "
                "install g++ or set CXX to one, use compile.backend = 'aot_eager', or set compile.enable = false"
            )
    elif device_type == "cuda" and not has_triton():
        return (
            "compile.enable = true with compile.backend = 'inductor' needs triton on GPUs and it is not "
            "installed; pip install triton, or set compile.enable = false"
        )
    return None


def apply_compile(model: nn.Module, compile_cfg) -> int:
    """torch.compile each block of `model.layers` in place (after apply_ac, before fully_shard); returns the count.

    `Module.compile` keeps the module and its parameter names; identical blocks share one compiled graph. An MoE
    block may break its graph where the routing's counts decide sizes (the token exchange reads them on the host);
    so may a model that says so (compile_fullgraph = False). A block holding one of the model's eager_modules() is
    compiled part by part: its other children each, the eager one not at all.
    """
    if not compile_cfg.enable:
        return 0
    whole = getattr(model, "compile_fullgraph", True) and not getattr(getattr(model, "args", None), "moe", False)
    eager = {id(m) for m in model.eager_modules()} if hasattr(model, "eager_modules") else set()
    for block in model.layers:
        if not any(id(m) in eager for m in block.modules()):
            block.compile(backend=compile_cfg.backend, fullgraph=whole)
            continue
        # the block's other parts, each compiled (a graph break inside a checkpointed block would leave it all eager)
        for child in block.children():
            if not any(id(m) in eager for m in child.modules()):
                child.compile(backend=compile_cfg.backend, fullgraph=whole)
    return len(model.layers)
