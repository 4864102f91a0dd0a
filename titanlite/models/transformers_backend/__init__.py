"""The transformers backend (model.name = "transformers"): any causal LM that transformers implements, built as
transformers' own class and trained with titanlite's FSDP/HSDP, checkpoints, chunked loss and data
(docs/model_families.md).

`args` reads a HuggingFace config into BackendArgs (shape, parameter counts, FLOPs), `model` is the nn.Module titanlite
shards and calls, `weights` draws its weights from (seed, module name), reads a HuggingFace folder into its shards and
writes one, and `support` refuses what the backend does not run (one line each).
"""

from titanlite.models.family import BACKEND

__all__ = ["BACKEND"]
