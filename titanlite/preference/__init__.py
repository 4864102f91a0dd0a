"""Preference fine-tuning ([dpo]): the pair losses, the reference model's log-probabilities, and the objective the
trainer calls per microbatch."""
