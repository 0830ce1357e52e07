"""What one block keeps for backward and makes during it, per token, by job: the vocabulary
(activation_terms.py), the saved activations per checkpointing policy (activations.py), attention's,
MoE's, the backward's transients, and what PEFT's frozen base does not keep. Torch-free."""
