"""The language backbone, the VLM assembly and tokenizers."""
