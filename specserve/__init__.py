"""specserve: a PyTorch-native LLM inference engine built around EAGLE-3 speculative decoding."""
