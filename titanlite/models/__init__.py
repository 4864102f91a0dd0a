"""Model families: shapes and flavors (torch-free: `registry`, `args`, one folder per family) and the torch
module every family builds (`decoder`)."""
