"""The model: a readable Llama (llama.py), its quantization methods and the byte tokenizer. Imports only torch."""
