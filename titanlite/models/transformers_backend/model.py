"""BackendModel: a transformers *ForCausalLM built from BackendArgs, as the nn.Module titanlite shards and calls.

The transformers model's children (`model`, `lm_head`) are this module's own, so its state-dict names are
transformers' (model.layers.0.self_attn.q_proj.weight, ...) and a HuggingFace export writes them as they are; the
model object itself is kept aside (`hf`) for its init and save code. Its lm_head is titanlite's OutputProjection:
given labels, forward returns the summed cross-entropy computed a chunk of tokens at a time, never the full logits.
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.models.decoder import OutputProjection
from titanlite.models.transformers_backend import weights
from titanlite.models.transformers_backend.args import STATE_LAYERS, BackendArgs, causal_lm_class


def build_text_config(hf_config: dict):
    """transformers' config object of BackendArgs.hf_config, set up as titanlite runs it: sdpa attention (packed
    documents masked by their position resets) and no cache while training."""
    import transformers

    data = dict(hf_config)
    text = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    text._attn_implementation = "sdpa"
    text.use_cache = False
    return text


class BackendCache:
    """transformers' own cache for a model's layers (DynamicCache: full and sliding attention, linear-attention and
    convolution states), with the positions it holds as titanlite's generation loop reads them."""

    def __init__(self, config, max_len: int):
        from transformers import DynamicCache

        self.hf, self.max_len, self.offset = DynamicCache(config=config), max_len, 0


class BackendModel(nn.Module):
    """A transformers causal LM with titanlite's model interface: shard_groups, init_weights(seed), layers, a forward
    that takes per-document positions and labels."""

    attention_kernel = "sdpa"
    aux_loss_sum = None  # (an MoE's auxiliary loss stays inside transformers' model: not added)
    compile_fullgraph = False  # [compile]: transformers' layers may break their graphs (data-dependent branches)

    def __init__(self, args: BackendArgs):
        super().__init__()
        self.args = args
        text = build_text_config(args.hf_config)
        hf = causal_lm_class(text, args.model_type)._from_config(text, dtype=torch.float32)
        head = hf.lm_head
        hf.lm_head = OutputProjection(head.in_features, head.out_features, bias=head.bias is not None)
        hf.tie_weights()
        if list(hf.named_parameters(recurse=False)) or list(hf.named_buffers(recurse=False)):
            raise ValueError(f"{type(hf).__name__} holds tensors of its own outside its modules")
        for name, child in hf.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "hf", hf)  # not a submodule: its children are ours
        for name, p in self.named_parameters():  # what no loss reaches (a sparse-attention indexer) is not trained
            if any(part in name for part in args.frozen):
                p.requires_grad_(False)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (activation checkpointing and compile wrap each)."""
        return self.model.layers

    @property
    def output(self) -> OutputProjection:
        """The output projection (as the native families name it: the dry run sizes the loss by it)."""
        return self.lm_head

    @property
    def loss_chunk_tokens(self) -> int:
        """Tokens per chunk of the output projection and loss when forward gets labels; 0: forward takes none."""
        return self.lm_head.chunk_tokens

    @loss_chunk_tokens.setter
    def loss_chunk_tokens(self, value: int) -> None:
        self.lm_head.chunk_tokens = value

    def shard_groups(self) -> list[list[nn.Module]]:
        """Modules to shard together, one list per fully_shard call: the embedding, each decoder layer, the final
        norm with the output projection (a tied output projection with the embedding); the root excluded."""
        base, layers = self.model, [[layer] for layer in self.model.layers]
        if self.args.tie_embeddings:
            return [[base.embed_tokens, self.lm_head]] + layers
        tail = [m for m in (getattr(base, "norm", None), self.lm_head) if m is not None]
        return [[base.embed_tokens]] + layers + [tail]

    def forward(self, tokens, positions=None, cache=None, labels=None, last_only: bool = False) -> torch.Tensor:
        """Logits, or given labels the summed cross-entropy; positions: each token's position in its document
        (attention.block_causal: documents packed in a row see only themselves); cache: a BackendCache (new_cache)
        that the tokens extend."""
        if cache is not None:
            h = self.model(input_ids=tokens, past_key_values=cache.hf, use_cache=True).last_hidden_state
            cache.offset += tokens.shape[1]
        else:
            position_ids = positions if self.args.attention == "block_causal" else None
            h = self.model(input_ids=tokens, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.lm_head(h[:, -1:] if last_only else h, labels)

    def eager_modules(self) -> list[nn.Module]:
        """The modules [compile] leaves uncompiled inside each compiled decoder layer: those that keep a state along
        the sequence (Gated DeltaNet, Mamba: transformers' PyTorch fallbacks reshape views that dynamo's traced
        backward cannot), found by their class names."""
        return [m for layer in self.layers for m in layer.modules() if STATE_LAYERS.search(type(m).__name__)]

    @property
    def device(self) -> torch.device:
        """The device the model computes on."""
        return self.model.embed_tokens.weight.device

    def new_cache(self, max_len: int) -> BackendCache:
        """An empty cache of the model's own kinds (attention, sliding-window, linear-attention states)."""
        return BackendCache(self.hf.config, max_len)

    def init_weights(self, seed: int) -> None:
        """Every weight drawn by the model's own initialisation, seeded by (seed, module name): the same whatever the
        sharding; then the buffers. A model whose folder holds every weight is not drawn (they are read next, or a
        checkpoint's): drawing holds a whole decoder layer on every rank."""
        if not self.args.hf_weights:
            weights.init_by_name(self.hf, seed)
        weights.init_adapters(self, seed)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers (rotary frequencies, embedding scales): garbage after to_empty."""
        weights.init_buffers(self.hf)

    def load_hf_folder(self, folder) -> None:
        """Fill this rank's shards from a HuggingFace folder's safetensors (transformers' loader and renamings); a
        folder with a config.json only leaves the weights drawn from the seed."""
        weights.load_folder(self.hf, folder, part=getattr(self, "pipeline_part", False))

    def save_hf_folder(self, out, dtype: torch.dtype, max_shard_size: str | int = "5GB") -> int:
        """Write the model as transformers saves it (call on every rank; rank 0 writes); the tensors written."""
        return weights.save_folder(self, out, dtype, max_shard_size)
