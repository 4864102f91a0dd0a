"""Model families: shapes and flavors (torch-free, `registry`, `llama_args`) and the torch modules (`llama`)."""
