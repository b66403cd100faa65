"""The decoder families pardec serves: one list, read by the gateway's MindIE rules (which models
parallel decoding is allowed for) and by the verifier's loader (which checkpoints it reads).

They share one block (RMSNorm, rotary attention with grouped kv heads, SwiGLU) and differ in:
Qwen2 and Qwen2.5 add biases to q, k and v; Qwen3 drops them, normalizes each head of q and k
with its own RMSNorm before rotary, and may set head_dim apart from hidden_size / heads; Llama
3.1-3.3 scale rotary frequencies ("llama3" rope type), and Qwen's long contexts with YaRN, which
the loader reads for any family (verifier/model/rotary.py).
"""

# Llama3 (llama), Qwen2 and Qwen2.5 (both qwen2), Qwen3 (qwen3): model_type in a Hugging Face
# config.json, general.architecture in a GGUF file.
ARCHITECTURES = ("llama", "qwen2", "qwen3")
WITH_QKV_BIAS = ("qwen2",)
WITH_QK_NORM = ("qwen3",)
