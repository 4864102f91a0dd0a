"""Data: tokenizers, document sources, the built-in corpus and the packed, resumable, DP-sharded loader."""
