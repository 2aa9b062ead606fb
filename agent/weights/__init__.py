"""The node's model weights: reading GGUF headers, sizing memory, picking a repository's GGUF set (SPEC MIR-3)."""
