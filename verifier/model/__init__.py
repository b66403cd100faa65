"""The served model: its shape (args), the decoder and its forward paths (modules, the CPU's fused
C layers, the device engine), W8A8 linear layers, the KV cache and a step's layout, checkpoints
and the tokenizer."""
