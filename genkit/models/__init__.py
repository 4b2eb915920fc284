"""Native models (Llama family, GPT-2), their cache, loading, and the transformers adapter."""
