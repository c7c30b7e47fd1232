"""Training engines behind one seam: torch (default); DeepSpeed and Megatron-core later."""
