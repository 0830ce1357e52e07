"""Parameter-efficient fine-tuning: LoRA and DoRA adapters on a frozen base (spec.py says what, torch-free;
adapters.py builds it)."""
