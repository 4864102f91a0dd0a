"""The Jinja environment chat templates render in: transformers' immutable sandbox, plus limits on what one render
may do, so that a template with runaway loops (nested loops over range(), a recursive macro) or a huge output ends
with a message instead of hanging a run or `generate --chat`.

A render may execute at most MAX_BLOCKS template blocks (each loop iteration, branch taken or macro call is one;
a chat template renders a long conversation in a few thousand), take at most MAX_SECONDS, produce at most
MAX_OUTPUT characters, and build no string or list longer than MAX_OUTPUT with `*` (nor a power beyond
MAX_EXPONENT). The block count makes the common runaway fail the same way on every machine.
"""

from __future__ import annotations

import threading
import time

import jinja2.compiler
import jinja2.sandbox
from jinja2 import TemplateError

__all__ = ["LimitedSandbox", "RenderLimitExceeded", "TemplateError"]

MAX_BLOCKS = 1_000_000
MAX_SECONDS = 10.0
MAX_OUTPUT = 16 * 2**20
MAX_EXPONENT = 4096


class RenderLimitExceeded(Exception):
    """A render went past one of the limits; the message says which."""


class _CountingCodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's code generator with a call to the environment's `tick()` at the start of every block."""

    def blockvisit(self, nodes, frame) -> None:
        self.writeline("environment.tick()")
        super().blockvisit(nodes, frame)


class LimitedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment whose renders (`render_limited`) stop at the module's limits."""

    code_generator_class = _CountingCodeGenerator
    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._state = threading.local()  # this thread's render: blocks run and its deadline

    def tick(self) -> None:
        """Count one executed block; RenderLimitExceeded past MAX_BLOCKS or the time limit."""
        state = self._state
        state.blocks += 1
        if state.blocks > MAX_BLOCKS:
            raise RenderLimitExceeded(f"it ran more than {MAX_BLOCKS:,} template blocks (loop iterations, branches)")
        if state.blocks % 1024 == 0 and time.monotonic() > state.deadline:
            raise RenderLimitExceeded(f"it ran longer than {MAX_SECONDS:g} s")

    def call_binop(self, context, operator: str, left, right):
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise RenderLimitExceeded(f"it raises to the power {right} (more than {MAX_EXPONENT})")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT:
                    raise RenderLimitExceeded(f"it repeats a sequence to more than {MAX_OUTPUT:,} items")
        return super().call_binop(context, operator, left, right)

    def render_limited(self, template: jinja2.Template, **variables) -> str:
        """template.render(**variables), stopped with RenderLimitExceeded at the module's limits."""
        state = self._state
        state.blocks, state.deadline = 0, time.monotonic() + MAX_SECONDS
        pieces, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT:
                raise RenderLimitExceeded(f"its output passed {MAX_OUTPUT:,} characters")
            pieces.append(piece)
        return "".join(pieces)
