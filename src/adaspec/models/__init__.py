"""Model store (GGUF parts -> verified cache) and model backends."""
