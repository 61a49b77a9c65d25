"""Built-in models (flax NNX): the dense transformer LM, the MoE LM, the ViT."""
