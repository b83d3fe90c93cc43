"""The model file: download and verify the GGUF, read its tensors and tokenizer, build the model."""
