"""titanlite: a small TorchTitan-style Llama training framework."""
