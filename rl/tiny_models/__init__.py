"""Models made on this machine, for runs and tests without a model hub: `tiny` (the embedded default's
byte-level BPE tokenizer and Qwen3-MoE config) and `twins` (random-weight HF checkpoints of each family,
written by transformers' own classes). Nothing here is imported by a role at run time except to write a
model directory the run then reads like any published checkpoint."""
