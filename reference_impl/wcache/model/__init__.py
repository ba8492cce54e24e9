"""The model: a readable Llama (llama.py), its quantization methods; and, torch-free, the checkpoint's
tokenizer and stop ids (tokenizer.py, generation_config.py)."""
