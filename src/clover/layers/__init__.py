"""Model building blocks: norms, rotary embedding, attention, Gated DeltaNet, mixture of experts."""
